"""Draw one simulated step of a vision encoder feeding an LLM (docs/vlm.md): encoder dp3 on ranks
0-2, LLM dp2 on ranks 3-4, a global batch of 7 (rows 3+2+2 and 4+3); with ``--microbatch`` every
replica runs microbatches of one row, so the LLM's microbatch k overlaps the encoder's k+1.

The instruction lists are the ones the runtime executes (``core.handoff_schedule.handoff_schedule``) and
``simulate_handoff`` replays them; the durations are illustrative (per row: encoder forward 1 ms,
LLM forward 3 ms, backward twice the forward, 0.2 ms per transfer, 0.1 ms link latency), not
measured: the picture shows the data flow and the waits, not a speed.

    python benchmarks/vlm_timeline.py docs/img/vlm_step_5rank.svg
    python benchmarks/vlm_timeline.py docs/img/vlm_step_5rank_mb1.svg --microbatch
"""

from __future__ import annotations

import sys

from lightning_distmm.core.handoff_schedule import handoff_schedules, routes
from lightning_distmm.core.plan import Plan
from lightning_distmm.core.schedule import Backward, Forward
from lightning_distmm.planner.cost.simulate import bubble_fraction, simulate_handoff
from lightning_distmm.planner.pictures.timeline import timeline_svg


def plan(microbatch: int | None) -> Plan:
    return Plan(
        5, {"image": {"ranks": [0, 1, 2], "microbatch": microbatch}, "llm": {"ranks": [3, 4], "microbatch": microbatch}}
    )


CONSUMES = {"llm": ["image"]}


def seconds(rank: int, ins: object) -> float:
    if isinstance(ins, (Forward, Backward)):
        per_row = 1e-3 if ins.tower == "image" else 3e-3
        return ins.rows * per_row * (2 if isinstance(ins, Backward) else 1)
    return 2e-4


def main(out: str | None, microbatch: int | None) -> None:
    PLAN = plan(microbatch)
    lists = handoff_schedules(PLAN, CONSUMES, ["image", "llm"], {"image": True, "llm": True}, 7)
    for r in routes(PLAN, CONSUMES, 7):
        print(f"rows {r.start}-{r.stop - 1}: rank {r.src} ({r.producer}) -> rank {r.dst} ({r.consumer})")
    for rank, lst in lists.items():
        print(f"rank {rank}: " + "  ".join(type(i).__name__ for i in lst))
    intervals = simulate_handoff(lists, seconds, 1e-4, {"llm": PLAN.towers["llm"].ranks})
    step = max(i.end for i in intervals)
    print(f"simulated step {step * 1e3:.2f} ms, idle share {bubble_fraction(intervals):.2f}")
    if out:
        svg = timeline_svg(
            intervals,
            "encoder dp3 (ranks 0-2) + LLM dp2 (ranks 3-4), batch 7: one step"
            + (f", microbatches of {microbatch} row" if microbatch else ""),
            note="illustrative durations (benchmarks/vlm_timeline.py); the lists are the runtime's",
        )
        with open(out, "w") as f:
            f.write(svg)
        print(f"wrote {out}")


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    main(args[0] if args else None, 1 if "--microbatch" in sys.argv else None)
