"""The schedule as data: instruction lists, their simulation and picture (pure Python)."""

import random

import pytest

from lightning_distmm.core import Plan
from lightning_distmm.core.schedule import (
    Backward,
    BatchSync,
    Forward,
    GradSync,
    SyncPost,
    SyncWait,
    rank_schedule,
    schedules,
)
from lightning_distmm.planner.cost.simulate import bubble_fraction, simulate
from lightning_distmm.planner.pictures.timeline import timeline_svg

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
    """Two sync groups of half the batch: after sync group 0's batch-sync, sync group 1's forwards
    alternate with sync group 0's backwards, after one warm-up forward on the first of two stages."""
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
    # odd batch: the first sync group takes the extra row, each sync group split in microbatches of 2
    assert [i.rows for i in rank_schedule(plan, 2, 7) if isinstance(i, Forward)] == [2, 2, 2, 1]


@pytest.mark.parametrize("stages", [2, 3, 4])
def test_distmm_holds_half_the_activations(stages):
    """Microbatches whose activations a stage holds at once: gpipe all of its replica's, distmm one
    sync group's plus its warm-up. In this compute-only simulation the step is no shorter: the last
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


DISTMM = Plan(
    3,
    {
        "image": {"ranks": [0, 1], "pp": 2, "microbatch": 2, "schedule": "distmm"},
        "text": {"ranks": [2], "microbatch": 2, "schedule": "distmm"},
    },
)


def test_async_batch_sync_posts_then_runs_the_next_wave():
    """``overlap``: sync group 0's batch-sync becomes a post (where the batch-sync was) and a wait (before
    the first backward), with one of sync group 1's forwards between them on the last stages; every
    stage runs one forward more ahead; the last batch-sync stays blocking."""
    first, last, text = (rank_schedule(DISTMM, r, 8, overlap=True) for r in range(3))
    kinds = lambda ins: [f"{type(i).__name__}{getattr(i, 'sync_group', '')}" for i in ins]  # noqa: E731
    assert kinds(first) == ["Forward0"] * 2 + ["Forward1"] * 2 + ["Backward0"] * 2 + ["Backward1"] * 2 + ["GradSync"]
    for ins, tower in ((last, "image"), (text, "text")):
        assert kinds(ins) == [
            "Forward0", "Forward0", "SyncPost0", "Forward1", "SyncWait0", "Backward0", "Forward1", "Backward0",
            "BatchSync1", "Backward1", "Backward1", "GradSync",
        ]  # fmt: skip
        assert ins[2] == SyncPost(0, (1, 2)) and ins[4] == SyncWait(0, (1, 2)) and ins[3].tower == tower
    # other schedules and one-group plans are unchanged
    assert rank_schedule(PLAN, 1, 8, overlap=True) == rank_schedule(PLAN, 1, 8)


def _sync_durations(f: float, b: float, gather: float, loss: float):
    """Durations where a blocking batch-sync costs its gather plus its loss: the same work either way."""

    def duration(rank, ins):
        parts = {"Forward": f, "Backward": b, "SyncPost": gather, "SyncWait": loss, "BatchSync": gather + loss}
        return parts.get(type(ins).__name__, 0.0)

    return duration


@pytest.mark.parametrize("gather", [0.0, 0.25, 0.5, 1.0, 2.0, 4.0])
def test_async_batch_sync_hides_the_gather_behind_a_forward(gather):
    """The simulator prices the gather in flight between post and wait: the step shortens by the part of
    sync group 0's gather one forward of sync group 1 covers (here min(gather, f)), and the gather is no longer busy time."""
    duration = _sync_durations(1.0, 2.0, gather, 0.5)
    blocking = simulate(schedules(DISTMM, 16), duration)
    overlapped = simulate(schedules(DISTMM, 16, overlap=True), duration)
    end = lambda iv: max(i.end for i in iv)  # noqa: E731
    assert end(overlapped) == pytest.approx(end(blocking) - min(gather, 1.0))
    post = [i for i in overlapped if isinstance(i.instruction, SyncPost)]
    assert len(post) == 2 and all(i.end - i.start == pytest.approx(gather) for i in post)
    assert "SyncPost" in timeline_svg(overlapped) and "SyncWait" in timeline_svg(overlapped)


@pytest.mark.parametrize("stages", [1, 2, 3, 4])
def test_async_batch_sync_is_never_slower(stages):
    """Over a grid of microbatch counts, compute times, gather lengths and transfer times, the
    overlapped lists never take longer than the blocking ones (one pipelined tower, alone and with
    a second one-stage tower), and hold one microbatch more per stage."""
    for towers in (1, 2):
        plan = Plan(
            stages + towers - 1,
            {
                "image": {"ranks": list(range(stages)), "pp": stages, "microbatch": 1, "schedule": "distmm"},
                **({"text": {"ranks": [stages], "microbatch": 1, "schedule": "distmm"}} if towers == 2 else {}),
            },
        )
        for rows in (4, 9, 16):
            for f, b in ((1.0, 2.0), (2.0, 1.0)):
                for gather in (0.0, 0.3, 1.0, 6.0):
                    for link in (0.0, 0.5):
                        duration = _sync_durations(f, b, gather, 0.5)
                        blocking = max(i.end for i in simulate(schedules(plan, rows), duration, link))
                        overlapped = max(i.end for i in simulate(schedules(plan, rows, True), duration, link))
                        assert overlapped <= blocking + 1e-9
    for rank in range(stages):
        live = peak = 0
        for i in rank_schedule(plan, rank, 16, overlap=True):
            live += isinstance(i, Forward) - isinstance(i, Backward)
            peak = max(peak, live)
        assert peak == 8 + stages - rank


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


@pytest.mark.parametrize(
    ("schedule", "overlap"), [("gpipe", False), ("cached", False), ("distmm", False), ("distmm", True)]
)
@pytest.mark.parametrize("rendezvous", [False, True])
def test_no_plan_deadlocks(schedule, overlap, rendezvous):
    """Every rank's list, receives blocking, collectives waiting for all their members (the batch-sync,
    an asynchronous batch-sync's wait: the feature gradients' all-reduce, the gradient sums), sends
    posted (gloo) or rendezvous (NCCL: complete only when received, and no collective posted while
    one is unmatched): the step always completes, for 400 random plans (towers sharing ranks in any
    order, pipelines, tp, replicas). Before the asynchronous wait's place was fixed, 113 of 400
    distmm+overlap plans deadlocked under rendezvous (55 with posted sends)."""
    rng = random.Random(schedule)
    for _ in range(400):
        plan = _random_plan(rng, schedule)
        lists = schedules(plan, rng.randint(2 * 6, 20), overlap)
        intervals = simulate(lists, lambda r, i: rng.random(), rendezvous=rendezvous)
        assert len(intervals) == sum(len(v) for v in lists.values())


def test_async_wait_comes_before_any_message_another_wait_holds_back():
    """The issue's plan: image pp2 on ranks 0, 1 and text on rank 0. Rank 0 received image gradients
    before its asynchronous wait while rank 1 sent them only after its own (the all-reduce needs rank
    0): a hang on any backend (seen on gloo). With two microbatches, rank 0 sent an activation before
    its wait that rank 1 received after its own: a hang where a send waits for its receive (NCCL).
    Now every sync rank waits right after the first slot's forwards."""
    for microbatch in (None, 1, 2):
        distmm = {"schedule": "distmm", "microbatch": microbatch}
        plan = Plan(2, {"image": {"ranks": [0, 1], "pp": 2, **distmm}, "text": {"ranks": [0], **distmm}})
        lists = schedules(plan, 8, overlap=True)
        for rendezvous in (False, True):
            simulate(lists, lambda r, i: 1.0, rendezvous=rendezvous)
        for ins in lists.values():
            wait = next(i for i, x in enumerate(ins) if isinstance(x, SyncWait))
            post = next(i for i, x in enumerate(ins) if isinstance(x, SyncPost))
            between = ins[post + 1 : wait]
            assert all(isinstance(x, Forward) and x.sync_group == 1 for x in between)
            assert len({x.tower for x in between}) == len(between)  # one forward per tower at most


def _random_handoff_plan(rng: random.Random) -> Plan:
    """An encoder feeding an LLM: either tower pipelined, tensor-parallel or replicated, on ranks that
    may be shared, in any order."""
    world = rng.randint(2, 6)
    towers = {}
    for name in ("image", "llm"):
        pp = rng.choice([d for d in (1, 2, 3) if d <= world])
        tp = rng.choice([d for d in (1, 2) if d * pp <= world])
        dp = rng.randint(1, world // (pp * tp))
        towers[name] = {"ranks": rng.sample(range(world), dp * pp * tp), "pp": pp, "tp": tp}
        towers[name]["microbatch"] = rng.choice([None, 1, 2])
    if set(range(world)) - {r for t in towers.values() for r in t["ranks"]}:
        return _random_handoff_plan(rng)  # every rank must hold a tower
    return Plan(world, towers)


def _opening_lists(links) -> dict[int, list[Forward]]:
    """``connect_in_order``'s walk over ``links`` as every rank's list: a send or a receive per link it ends."""
    lists: dict[int, list[Forward]] = {}
    for i, (*_, src, dst) in enumerate(links):
        lists.setdefault(src, []).append(Forward("link", i, 1, None, dst, False))
        lists.setdefault(dst, []).append(Forward("link", i, 1, src, None, False))
    return lists


def _deadlocks(run) -> int:
    try:
        run()
    except RuntimeError as err:
        assert "deadlocks" in str(err)
        return 1
    return 0


def test_no_plan_deadlocks_when_a_send_holds_its_rank(capsys):
    """The strictest send model: a send holds its whole rank until the receiver reaches the receive,
    what NCCL does at a link's first message (it creates the link's communicator then, blocking the
    caller until the peer joins). A step's lists deadlock under it for many plans whose towers share
    ranks in different stage orders (counted below); so the runtime opens every link at setup, one
    message each in one order on every rank (``parallel.pipeline.connect_in_order``), which completes
    under this model for every plan, and afterwards the step only posts its sends on opened links
    (``test_no_plan_deadlocks``' models)."""
    from lightning_distmm.core.handoff_schedule import handoff_links, handoff_schedules
    from lightning_distmm.parallel.pipeline import stage_pairs
    from lightning_distmm.planner.cost.simulate import simulate_handoff

    counts = {}
    for schedule, overlap in (("gpipe", False), ("cached", False), ("distmm", False), ("distmm", True)):
        rng = random.Random(schedule)
        step = opening = 0
        for _ in range(400):
            plan = _random_plan(rng, schedule)
            lists = schedules(plan, rng.randint(2 * 6, 20), overlap)
            step += _deadlocks(lambda: simulate(lists, lambda r, i: rng.random(), blocking_sends=True))
            links = [(t, kind, s, d) for t, a, b in stage_pairs(plan) for kind, s, d in (("act", a, b), ("grad", b, a))]
            opening += _deadlocks(lambda: simulate(_opening_lists(links), lambda r, i: 1.0, blocking_sends=True))
        counts[schedule + ("+overlap" if overlap else "")] = (step, opening)
    rng = random.Random("handoff")
    step = opening = 0
    consumes = {"llm": ["image"]}
    for _ in range(400):
        plan = _random_handoff_plan(rng)
        lists = handoff_schedules(plan, consumes, ["image", "llm"], {"image": True, "llm": True}, rng.randint(12, 20))
        llm = plan.towers["llm"]  # the target count's all-reduce: every replica's last stage
        dp = {"llm": [r for q in range(llm.dp) for r in llm.replica_ranks(q)[(llm.pp - 1) * llm.tp :]]}
        step += _deadlocks(lambda: simulate_handoff(lists, lambda r, i: rng.random(), 0.0, dp, blocking_sends=True))
        links = handoff_links(plan, consumes)
        links += [(t, kind, s, d) for t, a, b in stage_pairs(plan) for kind, s, d in (("act", a, b), ("grad", b, a))]
        opening += _deadlocks(lambda: simulate(_opening_lists(links), lambda r, i: 1.0, blocking_sends=True))
    counts["handoff"] = (step, opening)
    with capsys.disabled():
        print("\nof 400 random plans, deadlocked when a send holds its rank: the step's lists / the links' opening")
        for name, (step, opening) in counts.items():
            print(f"  {name:15} {step:4d} / {opening}")
    assert all(opening == 0 for _, opening in counts.values())
    assert counts["gpipe"][0] > 0  # the model sees what lazily created communicators would do
