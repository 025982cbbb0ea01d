"""The VLM handoff's schedule IR: row routes from the plan, each rank's list, its replay (no processes)."""

from __future__ import annotations

import itertools

import pytest

from lightning_distmm.core.handoff_schedule import (
    RecvTokenGrads,
    RecvTokens,
    SendTokenGrads,
    SendTokens,
    TokenLoss,
    handoff_schedules,
    routes,
)
from lightning_distmm.core.plan import Plan
from lightning_distmm.core.schedule import Backward, Forward
from lightning_distmm.planner.cost.simulate import simulate_handoff
from lightning_distmm.planner.pictures.timeline import timeline_svg

CONSUMES = {"llm": ["image"]}
ORDER = ["image", "llm"]


def five_rank_plan() -> Plan:
    return Plan(5, {"image": {"ranks": [0, 1, 2]}, "llm": {"ranks": [3, 4]}})


def test_routes_follow_row_ownership_uneven() -> None:
    """Image rows 3+2+2 (ranks 0-2), LLM rows 4+3 (ranks 3, 4): every row goes once, to its owner."""
    got = [(r.start, r.stop, r.src, r.dst) for r in routes(five_rank_plan(), CONSUMES, 7)]
    assert got == [(0, 3, 0, 3), (3, 4, 1, 3), (4, 5, 1, 4), (5, 7, 2, 4)]


@pytest.mark.parametrize("image_dp,llm_dp,n", [(1, 1, 4), (2, 1, 6), (3, 2, 7), (2, 3, 9), (4, 3, 10)])
def test_every_row_is_sent_once_and_lists_replay(image_dp: int, llm_dp: int, n: int) -> None:
    world = image_dp + llm_dp
    plan = Plan(world, {"image": {"ranks": list(range(image_dp))}, "llm": {"ranks": list(range(image_dp, world))}})
    rows = sorted(r for route in routes(plan, CONSUMES, n) for r in range(route.start, route.stop))
    assert rows == list(range(n))
    for trains in itertools.product([True, False], repeat=2):
        lists = handoff_schedules(plan, CONSUMES, ORDER, dict(zip(ORDER, trains)), n)
        sends = sum(isinstance(i, SendTokenGrads) for lst in lists.values() for i in lst)
        recvs = sum(isinstance(i, RecvTokenGrads) for lst in lists.values() for i in lst)
        assert sends == recvs == (len(routes(plan, CONSUMES, n)) if trains[0] else 0)
        intervals = simulate_handoff(lists, lambda r, i: 1.0, 0.1, {"llm": plan.towers["llm"].ranks})
        assert len(intervals) == sum(len(v) for v in lists.values())  # no deadlock: every instruction ran


def test_colocated_rank_hands_itself_its_rows() -> None:
    plan = Plan(4, {"image": {"ranks": [0, 1, 2]}, "llm": {"ranks": [2, 3]}})
    lists = handoff_schedules(plan, CONSUMES, ORDER, {"image": True, "llm": True}, 7)
    kinds = [type(i).__name__ for i in lists[2]]
    # its image forward and sends come before its LLM receives; its LLM backward before its image backward
    assert kinds.index("SendTokens") < kinds.index("RecvTokens") < kinds.index("TokenLoss")
    assert kinds.index("SendTokenGrads") < kinds.index("RecvTokenGrads")
    simulate_handoff(lists, lambda r, i: 1.0, 0.0, {"llm": [2, 3]})


def test_simulated_step_overlaps_nothing_it_must_wait_for() -> None:
    """The LLM's forward starts after the last token send it needs; the image backward after the grads arrive."""
    plan = five_rank_plan()
    lists = handoff_schedules(plan, CONSUMES, ORDER, {"image": True, "llm": True}, 7)

    def seconds(rank: int, ins: object) -> float:
        if isinstance(ins, (Forward, Backward)):
            return ins.rows * (1.0 if ins.tower == "image" else 3.0) * (2 if isinstance(ins, Backward) else 1)
        return 0.1

    iv = simulate_handoff(lists, seconds, 0.5, {"llm": [3, 4]})
    by = {(i.rank, type(i.instruction).__name__, getattr(i.instruction, "tower", "")): i for i in iv}
    # rank 0's 3 rows, its send, the link, then rank 3's two receives
    assert by[3, "Forward", "llm"].start == pytest.approx(3 * 1.0 + 0.1 + 0.5 + 2 * 0.1)
    llm_backward_end = max(by[r, "SendTokenGrads", ""].end for r in (3, 4))
    assert by[1, "Backward", "image"].start >= llm_backward_end + 0.5
    assert by[3, "TokenLoss", "llm"].start == by[4, "TokenLoss", "llm"].start  # the count's all-reduce
    svg = timeline_svg(iv, "encoder dp3 + LLM dp2")
    assert "SendTokens" in svg and "TokenLoss" in svg


def test_unsupported_plans_say_what() -> None:
    two_waves = {"microbatch": 1, "schedule": "distmm"}
    plan = Plan(3, {"image": {"ranks": [0, 1], **two_waves}, "llm": {"ranks": [2], **two_waves}})
    with pytest.raises(ValueError, match="has no batch-sync"):
        handoff_schedules(plan, CONSUMES, ORDER, {"image": True, "llm": True}, 4)


def test_pipelined_encoder_sends_from_its_last_stage_and_gets_the_gradient_there() -> None:
    """Encoder pp2 (ranks 0, 1) + LLM (rank 2): stage 1 sends the rows and receives their gradient;
    stage 0 only computes; the replay ends (no deadlock) with stage 0's backward after stage 1's."""
    plan = Plan(3, {"image": {"ranks": [0, 1], "pp": 2, "microbatch": 2}, "llm": {"ranks": [2]}})
    lists = handoff_schedules(plan, CONSUMES, ORDER, {"image": True, "llm": True}, 4)
    kinds = {r: [type(i).__name__ for i in lst] for r, lst in lists.items()}
    assert kinds[0] == ["Forward", "Forward", "Backward", "Backward", "GradSync"]
    assert kinds[1].count("SendTokens") == 2 and kinds[1].count("RecvTokenGrads") == 2
    iv = simulate_handoff(lists, lambda r, ins: 1.0, 0.0, {"llm": [2]})
    end = {(i.rank, type(i.instruction).__name__, getattr(i.instruction, "mb", -1)): i for i in iv}
    for mb in (0, 1):
        assert end[0, "Backward", mb].start >= end[1, "Backward", mb].end
        assert end[1, "Forward", mb].start >= end[0, "Forward", mb].end


def test_pipelined_llm_receives_on_its_first_stage_and_computes_the_loss_on_its_last() -> None:
    plan = Plan(4, {"image": {"ranks": [0, 1]}, "llm": {"ranks": [2, 3], "pp": 2}})
    lists = handoff_schedules(plan, CONSUMES, ORDER, {"image": True, "llm": True}, 6)
    kinds = {r: [type(i).__name__ for i in lst] for r, lst in lists.items()}
    assert kinds[2] == [
        "RecvTokens",
        "RecvTokens",
        "Forward",
        "Backward",
        "SendTokenGrads",
        "SendTokenGrads",
        "GradSync",
    ]
    assert kinds[3] == ["Forward", "TokenLoss", "Backward", "GradSync"]
    simulate_handoff(lists, lambda r, i: 1.0, 0.0, {"llm": [3]})


@pytest.mark.parametrize("image_mb,llm_mb,llm_pp", [(2, 3, 1), (1, 2, 1), (3, 2, 2), (None, 1, 2)])
def test_microbatched_routes_cover_every_row_once_and_replay(image_mb, llm_mb, llm_pp) -> None:
    plan = Plan(
        4,
        {
            "image": {"ranks": [0, 1], "microbatch": image_mb},
            "llm": {"ranks": [2, 3], "pp": llm_pp, "microbatch": llm_mb},
        }
        if llm_pp > 1
        else {"image": {"ranks": [0, 1], "microbatch": image_mb}, "llm": {"ranks": [2, 3], "microbatch": llm_mb}},
    )
    links = routes(plan, CONSUMES, 8)
    rows = sorted(r for route in links for r in range(route.start, route.stop))
    assert rows == list(range(8))
    assert all(r.src_offset <= r.start and r.dst_offset <= r.start for r in links)
    lists = handoff_schedules(plan, CONSUMES, ORDER, {"image": True, "llm": True}, 8)
    last = [r for r in plan.towers["llm"].ranks if r in (3,)] if llm_pp > 1 else [2, 3]
    iv = simulate_handoff(lists, lambda r, i: 1.0, 0.1, {"llm": last})
    assert len(iv) == sum(len(v) for v in lists.values())
    for r in lists:  # a rank runs one instruction at a time, in its list's order
        mine = [i for i in iv if i.rank == r]
        assert all(a.end <= b.start + 1e-12 for a, b in zip(mine, mine[1:]))


def test_instruction_names() -> None:
    assert {SendTokens, RecvTokens, TokenLoss} <= {
        type(i)
        for lst in handoff_schedules(five_rank_plan(), CONSUMES, ORDER, {"image": True, "llm": True}, 7).values()
        for i in lst
    }


@pytest.mark.parametrize(
    "towers",
    [
        {"image": {"ranks": [0, 1, 2]}, "llm": {"ranks": [3, 4]}},
        {"image": {"ranks": [0]}, "llm": {"ranks": [1, 2], "tp": 2}},
        {"image": {"ranks": [0, 1], "tp": 2}, "llm": {"ranks": [2]}},
        {"image": {"ranks": [0, 1, 2, 3]}, "llm": {"ranks": [0, 1, 2, 3], "pp": 2, "microbatch": 1}},
    ],
    ids=["dp3-dp2", "llm-tp2", "image-tp2", "colocated-llm-pp2"],
)
def test_every_message_has_its_link(towers) -> None:
    """Every transfer of every rank's list, at any batch, runs over one of :func:`handoff_links`' pairs
    (the runtime's per-pair process groups), and a rank never has a link to itself."""
    from lightning_distmm.core.handoff_schedule import SendTokenGrads, SendTokens, handoff_links

    world = len({r for t in towers.values() for r in t["ranks"]})
    plan = Plan(world, towers)
    consumes = {"llm": ["image"]}
    links = set(handoff_links(plan, consumes))
    assert all(src != dst for _, src, dst in links)
    for n in (4, 7, 12):
        for rank, instrs in handoff_schedules(
            plan, consumes, ["image", "llm"], {"image": True, "llm": True}, n
        ).items():
            for ins in instrs:
                if isinstance(ins, SendTokens) and ins.route.dst != rank:
                    assert ("tokens", rank, ins.route.dst) in links
                if isinstance(ins, SendTokenGrads) and ins.peer != rank:
                    assert ("grads", rank, ins.peer) in links
