"""The schedule as data: instruction lists, their simulation and picture (pure Python)."""

import pytest

from lightning_distmm.plan import Plan
from lightning_distmm.plan.schedule import (
    Backward,
    BatchSync,
    Forward,
    GradSync,
    bubble_fraction,
    rank_schedule,
    schedules,
    simulate,
    timeline_svg,
)

PLAN = Plan(3, {"image": {"ranks": [0, 1], "pp": 2, "microbatch": 2}, "text": {"ranks": [2], "microbatch": 4}})


def test_rank_lists_follow_the_pipeline():
    first, last, text = (rank_schedule(PLAN, r, 8) for r in range(3))
    assert first[:4] == [Forward("image", m, 2, None, 1, True) for m in range(4)]
    assert last[0] == Forward("image", 0, 2, 0, None, True)
    assert first[4] == last[4] == BatchSync() and first[-1] == GradSync()
    assert first[5] == Backward("image", 0, 2, 1, None, recompute=False)
    assert text == [Forward("text", 0, 4, None, None, True), Forward("text", 1, 4, None, None, True), BatchSync(),
                    Backward("text", 0, 4, None, None, False), Backward("text", 1, 4, None, None, False), GradSync()]


def test_cached_recomputes_and_keeps_nothing():
    plan = Plan(2, {"image": {"ranks": [0, 1], "pp": 2, "microbatch": 3, "schedule": "cached"}, "text": {"ranks": [0]}})
    ins = rank_schedule(plan, 1, 7)
    assert [i.rows for i in ins if isinstance(i, Forward)] == [3, 3, 1]
    assert all(not i.keep for i in ins if isinstance(i, Forward))
    assert all(i.recompute for i in ins if isinstance(i, Backward))


@pytest.mark.parametrize("k", [1, 2, 4, 8])
def test_gpipe_bubble_matches_the_textbook(k):
    """Two stages, k equal microbatches, backward twice the forward: bubble (p-1)/(k+p-1) of the pipeline."""
    plan = Plan(2, {"image": {"ranks": [0, 1], "pp": 2, "microbatch": 1}})
    lists = schedules(plan, k)

    def duration(rank, ins):
        return 1.0 if isinstance(ins, Forward) else 2.0 if isinstance(ins, Backward) else 0.0

    intervals = simulate(lists, duration)
    assert bubble_fraction(intervals) == pytest.approx(1 / (k + 1))
    assert max(i.end for i in intervals) == pytest.approx(3 * (k + 1))
    assert timeline_svg(intervals, "gpipe").startswith("<svg")


def test_simulator_reports_a_deadlock():
    bad = {0: [Forward("t", 0, 1, 1, None, True)], 1: [Forward("t", 0, 1, 0, None, True)]}
    with pytest.raises(RuntimeError, match="deadlocks"):
        simulate(bad, lambda r, i: 1.0)
