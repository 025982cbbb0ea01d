"""How close each step's cost-balanced row assignment comes to the ideal, against the even split.

For each workload (images per sample as the VLM planner's ``WORKLOADS`` give them, caption
lengths drawn uniformly from half to one and a half times the workload's mean) and each number of
rows per encoder replica, draws global batches and prints, over them, the mean of
``slowest replica's load / mean replica load``: the encoder's load is its replicas' images, the LLM's
its tokens (text plus ``tokens_per_image`` per image). ``even`` is the plan's split in sample order,
``balanced`` what :func:`~lightning_distmm.core.assignment.balance_rows` assigns (one step order for
both towers, each cut into its own runs); ``model`` is the planner's straggler price of the even
split (``planner.vlm.profile.straggler``, which prices the images' spread and not the captions'),
``bound`` the least any assignment of whole rows can reach (``max(largest row, mean load rounded up) / mean``: the loads are whole counts).

This measures the assignment (pure Python, no timing); ``docs/runtime.md`` ("Balancing each step")
quotes its table.

    python benchmarks/assignment_quality.py [--batches 200] [--dp 16]
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lightning_distmm.core.assignment import RowAssignment, balance_rows, loads  # noqa: E402
from lightning_distmm.core.plan import Plan  # noqa: E402
from lightning_distmm.planner.vlm.profile import WORKLOADS, straggler  # noqa: E402
from lightning_distmm.planner.vlm.sizes import PRESETS  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=int, default=200)
    parser.add_argument("--dp", type=int, default=16, help="encoder and LLM replicas (each on its own ranks)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    dp = args.dp
    plan = Plan(2 * dp, {"image": {"ranks": list(range(dp))}, "llm": {"ranks": list(range(dp, 2 * dp))}})
    rng = random.Random(args.seed)
    print(f"slowest / mean replica load, mean of {args.batches} batches; encoder dp {dp}, LLM dp {dp}")
    print(
        f"{'workload':<14}{'rows/rep':>9} | {'enc model':>9}{'even':>7}{'balanced':>9}{'bound':>7} |"
        f" {'llm model':>9}{'even':>7}{'balanced':>9}{'bound':>7}"
    )
    for name in ("llava15_7b", "internvl_26b"):
        w = WORKLOADS[name]
        per_image = PRESETS[w.preset].tokens_per_image
        counts, weights = list(w.images), list(w.images.values())
        for rows in (1, 2, 4, 8):
            n = rows * dp
            cols: dict[str, list[float]] = {k: [] for k in ("ie", "ib", "i0", "le", "lb", "l0")}
            for _ in range(args.batches):
                images = rng.choices(counts, weights, k=n)
                text = [rng.randint(w.text_tokens // 2, 3 * w.text_tokens // 2) for _ in range(n)]
                enc = [float(i) for i in images]
                llm = [float(t + i * per_image) for t, i in zip(text, images)]
                even = RowAssignment.even(plan, n)
                balanced = balance_rows(plan, n, {"image": enc, "llm": llm})
                for key, a, tower, cost in (
                    ("ie", even, "image", enc),
                    ("ib", balanced, "image", enc),
                    ("le", even, "llm", llm),
                    ("lb", balanced, "llm", llm),
                ):
                    mean = sum(cost) / dp
                    if mean > 0:
                        cols[key].append(max(loads(a, plan, tower, cost)) / mean)
                for key, cost in (("i0", enc), ("l0", llm)):
                    mean = sum(cost) / dp
                    if mean > 0:
                        cols[key].append(max(max(cost), math.ceil(mean)) / mean)  # whole counts
            m = {k: statistics.mean(v) for k, v in cols.items()}
            enc_model = straggler(w, rows, dp)
            llm_model = straggler(w, rows, dp, per_image, w.text_tokens)
            print(
                f"{name:<14}{rows:>9} | {enc_model:>9.3f}{m['ie']:>7.3f}{m['ib']:>9.3f}{m['i0']:>7.3f} |"
                f" {llm_model:>9.3f}{m['le']:>7.3f}{m['lb']:>9.3f}{m['l0']:>7.3f}"
            )


if __name__ == "__main__":
    main()
