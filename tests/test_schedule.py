"""The schedule as data: instruction lists, their simulation and picture (pure Python)."""

import random

import pytest

from lightning_distmm.core import Plan
from lightning_distmm.core.schedule import (
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
    # only the last stages meet at the batch-sync: the first stage goes straight on to its backward
    assert last[4] == BatchSync(0, (1, 2)) and BatchSync(0, (1, 2)) not in first and first[-1] == GradSync()
    assert first[4] == Backward("image", 0, 2, 1, None, recompute=False)
    assert text == [
        Forward("text", 0, 4, None, None, True),
        Forward("text", 1, 4, None, None, True),
        BatchSync(0, (1, 2)),
        Backward("text", 0, 4, None, None, False),
        Backward("text", 1, 4, None, None, False),
        GradSync(),
    ]


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


def test_distmm_overlaps_one_wave_with_the_next():
    """Two waves (sync groups) of half the batch: after wave 0's batch-sync, wave 1's forwards
    alternate with wave 0's backwards, after one warm-up forward on the first of two stages."""
    plan = Plan(
        3,
        {
            "image": {"ranks": [0, 1], "pp": 2, "microbatch": 2, "schedule": "distmm"},
            "text": {"ranks": [2], "microbatch": 2, "schedule": "distmm"},
        },
    )
    first, last, text = (rank_schedule(plan, r, 8) for r in range(3))
    kinds = lambda ins: [f"{type(i).__name__[0]}{getattr(i, 'sync_group', '')}" for i in ins]  # noqa: E731
    assert kinds(first) == ["F0", "F0", "F1", "B0", "F1", "B0", "B1", "B1", "G"]
    assert kinds(last) == ["F0", "F0", "B0", "B0", "F1", "B0", "F1", "B1", "B1", "B1", "G"]
    assert [i.mb for i in first if isinstance(i, Forward)] == [0, 1, 2, 3]
    assert last[2] == BatchSync(0, (1, 2)) and text[2] == BatchSync(0, (1, 2))
    # odd batch: the first sync group takes the extra row, each wave split in microbatches of 2
    assert [i.rows for i in rank_schedule(plan, 2, 7) if isinstance(i, Forward)] == [2, 2, 2, 1]


@pytest.mark.parametrize("stages", [2, 3, 4])
def test_distmm_holds_half_the_activations(stages):
    """Microbatches whose activations a stage holds at once: gpipe all of its replica's, distmm one
    wave's plus its warm-up. In this compute-only simulation the step is no shorter: the last
    stage does all its work plus a second batch-sync; the warm-up keeps deeper pipelines from
    paying a forward round trip per microbatch (docs/pipeline.md)."""

    def plan(schedule):
        return Plan(
            stages, {"image": {"ranks": list(range(stages)), "pp": stages, "microbatch": 1, "schedule": schedule}}
        )

    def duration(rank, ins):
        return {"Forward": 1.0, "Backward": 2.0, "BatchSync": 0.5}.get(type(ins).__name__, 0.0)

    def held(ins):
        live = peak = 0
        for i in ins:
            live += isinstance(i, Forward) - isinstance(i, Backward)
            peak = max(peak, live)
        return peak

    for rank in range(stages):
        assert held(rank_schedule(plan("gpipe"), rank, 16)) == 16
        assert held(rank_schedule(plan("distmm"), rank, 16)) == 8 + (stages - 1 - rank)
    gpipe = simulate(schedules(plan("gpipe"), 16), duration)
    distmm = simulate(schedules(plan("distmm"), 16), duration)
    assert max(i.end for i in distmm) == max(i.end for i in gpipe) + 0.5  # the second batch-sync


def _random_plan(rng: random.Random, schedule: str) -> Plan:
    world = rng.randint(1, 6)
    towers = {}
    for name in ("image", "text", "audio")[: rng.randint(1, 3)]:
        pp = rng.choice([d for d in (1, 2, 3) if d <= world])
        tp = rng.choice([d for d in (1, 2) if d * pp <= world])
        dp = rng.randint(1, world // (pp * tp))
        towers[name] = {
            "ranks": rng.sample(range(world), dp * pp * tp),
            "pp": pp,
            "tp": tp,
            "microbatch": rng.choice([None, 1, 2]),
            "schedule": schedule,
        }
    unheld = set(range(world)) - {r for t in towers.values() for r in t["ranks"]}
    first = next(iter(towers.values()))
    if unheld:  # give idle ranks to the first tower as one-rank-wide extra replicas when its shape allows
        if first["pp"] * first["tp"] != 1:
            return _random_plan(rng, schedule)
        first["ranks"] += sorted(unheld)
    return Plan(world, towers)


@pytest.mark.parametrize("schedule", ["gpipe", "cached", "distmm"])
def test_no_plan_deadlocks(schedule):
    """Every rank's list, sends posted without blocking, receives and syncs blocking: the step always
    completes, for random plans (towers sharing ranks in any order, pipelines, tp, replicas)."""
    rng = random.Random(schedule)
    for _ in range(300):
        plan = _random_plan(rng, schedule)
        lists = schedules(plan, rng.randint(2 * 6, 20))
        intervals = simulate(lists, lambda r, i: rng.random())
        assert len(intervals) == sum(len(v) for v in lists.values())
