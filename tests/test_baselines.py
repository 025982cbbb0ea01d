"""The baselines name what they are (Megatron-LM, FSDP, DDP, the uniform+batchsync ablation), the
precision policy sets the bytes per parameter, sharding divides them, and collectives pick NCCL's
protocol by message size."""

from __future__ import annotations

import pytest
import yaml

from lightning_distmm.planner import make_plan
from lightning_distmm.planner.cost import (
    CostOptions,
    evaluate_plan,
    grad_bytes_per_device,
    memory_per_device,
    precision_policy,
    static_per_param,
)
from lightning_distmm.planner.cost.memory import gathered_layers_bytes
from lightning_distmm.planner.cost.nccl import choose_protocol
from lightning_distmm.planner.machine.cluster import CONF_DIR
from lightning_distmm.planner.measure.local import load_cluster
from lightning_distmm.planner.profiles.profile import model_profiles
from lightning_distmm.planner.search.baselines import BASELINES, baseline_space, colocated_search
from lightning_distmm.planner.search.job import SearchJob
from lightning_distmm.planner.search.report import describe

ALL_SHARDS = {"shards": ["none", "optimizer", "zero2", "full", "hybrid"]}  # every sharding the runtime runs


def model(name: str) -> dict:
    return yaml.safe_load((CONF_DIR / "model" / f"{name}.yaml").read_text())


# ---------------------------------------------------------------------- precision policy
def test_precision_policy_bytes():
    """bf16-mixed: 2 (bf16 weights) + 4 (fp32 gradients) + 12 (fp32 master + Adam m, v) = 18 B, as
    Megatron-LM's distributed-optimizer documentation counts; fp32: 4 + 4 + 8 = 16 B."""
    bf16, fp32 = CostOptions(precision="bf16-mixed"), CostOptions(precision="fp32")
    assert (bf16.policy.weights, bf16.policy.grads, bf16.policy.optimizer) == (2, 4, 12)
    assert bf16.static_bytes_trainable == 18 and bf16.bytes_el == 2 and bf16.grad_bytes == 4
    assert (fp32.policy.weights, fp32.policy.grads, fp32.policy.optimizer) == (4, 4, 8)
    assert fp32.static_bytes_trainable == 16 and fp32.bytes_el == 4 and fp32.grad_bytes == 4
    assert precision_policy("32") == precision_policy("fp32")  # Lightning's name
    with pytest.raises(ValueError, match="precision"):
        CostOptions(precision="int8")


def test_gradients_reduced_in_fp32_under_bf16_mixed():
    p = model_profiles(model("clip_vit_l14"))["image"]
    for precision in ("bf16-mixed", "fp32"):
        o = CostOptions(precision=precision)
        assert grad_bytes_per_device(p, o, 1, 1) == pytest.approx(4 * p.params)


@pytest.mark.parametrize("dp", [1, 8, 64])
def test_sharding_divides_the_static_bytes(dp):
    """ZeRO-1 (Megatron's distributed optimizer): 6 + 12/d B per parameter; ZeRO-3: 18/d; a frozen
    tower holds its bf16 weights (split under ZeRO-3)."""
    profiles = model_profiles(model("lit_l16_bert_large"))
    trained, frozen = profiles["text"], profiles["image"]
    assert frozen.frozen and not trained.frozen
    o = CostOptions()
    assert static_per_param(trained, o, "none", dp) == pytest.approx(18)
    assert static_per_param(trained, o, "optimizer", dp) == pytest.approx(6 + 12 / dp)
    assert static_per_param(trained, o, "full", dp) == pytest.approx(18 / dp)
    assert static_per_param(frozen, o, "none", dp) == pytest.approx(2)
    assert static_per_param(frozen, o, "full", dp) == pytest.approx(2 / dp)


def test_fsdp_memory_is_one_shard_of_the_state():
    """The fsdp baseline's static memory per rank under ZeRO-3 is 1/dp of weights + gradients +
    optimizer state, plus the two layers FSDP2 holds gathered (the one computing, the one
    prefetched); under ZeRO-2 (reshard_after_forward=False) the bf16 weights stay whole, gradients
    and optimizer state are 1/dp, plus one layer's gradients before their reduce-scatter."""
    from lightning_distmm.planner.cost import TowerChoice

    cl = load_cluster("a100_8x8")
    profiles = model_profiles(model("clip_vit_bigg14"))
    _, rep = make_plan(model("clip_vit_bigg14"), cl, 4096, ALL_SHARDS)
    fsdp = rep.baselines["fsdp"]
    assert fsdp is not None
    o = CostOptions()
    for name, ch in fsdp.choices.items():
        p = profiles[name]
        assert ch.shard in ("full", "zero2") and (ch.tp, ch.pp, ch.dp) == (1, 1, cl.world_size)
        for shard in ("full", "zero2"):
            c = TowerChoice(name, ch.n, 1, 1, ch.microbatch, ch.schedule, ch.replica_batch, shard)
            static = evaluate_plan(profiles, cl, o, {**fsdp.choices, name: c}, fsdp.ranks, 4096).towers[name]
            if shard == "full":
                expected = p.params * o.static_bytes_trainable / ch.dp + gathered_layers_bytes(p, o, 1)
            else:
                expected = p.params * (2 + 16 / ch.dp) + p.layer.params * 4
            assert static.memory["static"] == pytest.approx(expected)
        # and the same tower unsharded holds dp times its share
        full = memory_per_device(p, o, ch.schedule, ch.microbatch, ch.K, ch.max_batch, 1, 1)["static"]
        assert float(full) == pytest.approx(p.params * 18)


# ---------------------------------------------------------------------- baselines
@pytest.mark.parametrize(
    "name, cluster, batch",
    [("clip_vit_l14", "a100_8x8", 4096), ("clip_vit_bigg14", "a100_8x8", 4096), ("distmm_4b", "h100_8x8", 2048)],
)
def test_megatron_runs_one_microbatch_per_pipeline(name, cluster, batch):
    """Megatron-LM's pipeline computes a loss per microbatch: a contrastive batch cannot be split, so
    each pipeline runs its whole replica batch as one microbatch; one tp x pp for every tower; ZeRO-1."""
    _, rep = make_plan(model(name), cluster, batch, ALL_SHARDS)
    meg = rep.baselines["megatron"]
    assert meg is not None
    assert len({(c.tp, c.pp, c.dp) for c in meg.choices.values()}) == 1
    for c in meg.choices.values():
        assert c.K == 1 and c.microbatch == c.max_batch
        assert c.shard == "optimizer" and c.schedule in ("gpipe", "gpipe+recompute")


def test_megatron_space_is_restricted():
    profiles = model_profiles(model("clip_vit_bigg14"))
    sp = baseline_space("megatron", profiles, 8, 64)
    assert sp.max_k == 1 and sp.max_microbatches == 1 and sp.shards == ("optimizer", "full")  # ZeRO-1, Megatron-FSDP
    assert "cached" not in sp.schedules and "distmm" not in sp.schedules
    assert baseline_space("fsdp", profiles, 8, 64).shards == ("full", "zero2", "hybrid")  # ZeRO-3, ZeRO-2, HSDP
    assert baseline_space("ddp", profiles, 8, 64).shards == ("none",)
    with pytest.raises(ValueError, match="baseline"):
        baseline_space("deepspeed", profiles, 8, 64)


def test_uniform_batchsync_ablation_may_split_the_batch():
    """The ablation keeps today's column: uniform degrees with this package's many-microbatch pipeline."""
    _, rep = make_plan(model("distmm_26b"), "a100_8x8", 4096, ALL_SHARDS)
    meg = rep.baselines["megatron"]  # ZeRO-1 fits no uniform split of one microbatch: Megatron-FSDP does
    assert meg is not None and {c.shard for c in meg.choices.values()} == {"full"}
    ab = rep.baselines["uniform+batchsync"]
    assert ab is not None and max(c.K for c in ab.choices.values()) > 1


def test_baselines_priced_like_any_plan():
    """Each baseline's price is evaluate_plan's price of its choices (one cost model for all)."""
    cl = load_cluster("a100_8x8")
    profiles = model_profiles(model("clip_vit_h14"))
    o = CostOptions()
    for kind in BASELINES:
        ev = colocated_search(
            profiles, SearchJob(cl, o, 2048, cl.world_size, baseline_space(kind, profiles, 8, 64)), kind
        )
        assert ev is not None and ev.name == kind
        again = evaluate_plan(profiles, cl, o, ev.choices, ev.ranks, 2048)
        assert again.step_time == pytest.approx(ev.step_time)


def test_default_options_never_shard():
    """The default options keep every tower's state replicated (planner.shards = [none]); with ZeRO-1
    allowed the plan holds only the shardings asked for, and the runtime's plan takes it."""
    plan, rep = make_plan(model("distmm_10b"), "h200_8x8", 1024)
    assert all(c.shard == "none" for c in rep.chosen.choices.values())
    assert all(t.shard == "none" for t in plan.towers.values())
    zero1, _ = make_plan(model("distmm_10b"), "h200_8x8", 1024, {"shards": ["none", "optimizer"]})
    assert {t.shard for t in zero1.towers.values()} <= {"none", "optimizer"}
    assert rep.baselines["megatron"] is not None
    assert {c.shard for c in rep.baselines["megatron"].choices.values()} <= {"optimizer", "full"}


def test_sharding_lets_a_big_tower_fit_without_deep_tp():
    """A 26B model: with ZeRO-3 allowed the planner may hold the image tower as sharded data
    parallelism; the choice is priced and fits."""
    _, rep = make_plan(model("distmm_26b"), "a100_8x8", 4096, ALL_SHARDS)
    plain = make_plan(model("distmm_26b"), "a100_8x8", 4096)[1]
    assert rep.step_time <= plain.step_time * (1 + 1e-9)
    assert rep.chosen.cost.extra["fits"]


# ---------------------------------------------------------------------- NCCL protocols
@pytest.mark.parametrize(
    "nbytes, protocol",
    [(64e3, "LL"), (8e6, "LL128"), (256e6, "Simple")],
)
def test_nccl_protocol_by_message_size(nbytes, protocol):
    """An all-reduce over the 8 GPUs of an A100 node: a tensor-parallel activation (64 KB) goes LL, a
    medium message LL128, a gradient bucket set Simple (NCCL v2.30.7's constants)."""
    cl = load_cluster("a100_8x8")
    got = choose_protocol("ampere", cl.intra.effective, cl.inter.effective, 2, 8, 1, 2 * 7 / 8 * nbytes, 0.0)
    assert got == protocol


def test_small_tp_allreduce_is_cheaper_than_simple_ring_latency():
    """At tp 8 the Simple ring's latency alone is 8.4 + 14 x 3.4 = 56 us; a small all-reduce costs less."""
    from lightning_distmm.planner.cost import allreduce_time

    cl = load_cluster("a100_8x8")
    assert allreduce_time(cl, 64e3, 8, 1, 8) < 20e-6
    assert allreduce_time(cl, 1e9, 8, 1, 8) > 5e-3


# ---------------------------------------------------------------------- Megatron's block recompute
def test_megatron_recomputes_only_the_layers_memory_requires():
    """Megatron-LM and NeMo recompute in blocks (``--recompute-method block --recompute-num-layers N``,
    per tower): the megatron baseline recomputes the fewest layers per stage that fit, not the whole
    tower. distmm_10b at 4,096 on 64 A100s: each tower recomputes part of its layers; one layer fewer
    on either no longer fits, and the plan is faster than recomputing everything."""
    import dataclasses

    from lightning_distmm.planner.cost import RECOMPUTE
    from lightning_distmm.planner.search.baselines import baseline_options

    cfg = model("distmm_10b")
    cl = load_cluster("a100_8x8")
    _, rep = make_plan(cfg, cl, 4096, ALL_SHARDS)
    meg = rep.baselines["megatron"]
    o = baseline_options("megatron", CostOptions())
    assert meg is not None and meg.cost.extra["fits"]
    profiles = model_profiles(cfg)
    partial = {n: c for n, c in meg.choices.items() if c.recompute_layers is not None}
    assert partial, "no tower recomputes part of its layers"
    for name, ch in partial.items():
        per_stage = profiles[name].layers // ch.pp
        assert ch.schedule == RECOMPUTE and 0 <= ch.recompute_layers < per_stage
        if ch.recompute_layers > 0:
            fewer = {**meg.choices, name: dataclasses.replace(ch, recompute_layers=ch.recompute_layers - 1)}
            assert not evaluate_plan(profiles, cl, o, fewer, meg.ranks, 4096).extra["fits"]
    assert len(partial) == 2
    full = {n: dataclasses.replace(c, recompute_layers=None) for n, c in meg.choices.items()}
    assert meg.step_time < evaluate_plan(profiles, cl, o, full, meg.ranks, 4096).step_time
    assert evaluate_plan(profiles, cl, o, meg.choices, meg.ranks, 4096).step_time == pytest.approx(meg.step_time)
    print(f"megatron on distmm_10b: {describe(meg)}")


def test_partial_recompute_runs_between_none_and_all_layers():
    """Time and memory of recomputing k of a stage's layers: k = all is full recomputation, k = 0 is
    gpipe, and both grow / shrink monotonically in between."""
    import dataclasses

    from lightning_distmm.planner.cost import RECOMPUTE, TowerChoice

    cfg = model("clip_vit_l14")
    profiles = model_profiles(cfg)
    cl = load_cluster("a100_8x8").with_world(8)
    ranks = {n: list(range(8)) for n in profiles}

    def step(schedule: str, k: int | None) -> tuple[float, float]:
        ch = {
            n: TowerChoice(n, 8, 1, 1, 64, schedule, (64,) * 8, "none", k if n == "image" else None) for n in profiles
        }
        ch["text"] = dataclasses.replace(ch["text"], schedule="gpipe")
        c = evaluate_plan(profiles, cl, CostOptions(), ch, ranks, 512)
        return c.step_time, c.extra["peak_memory"]

    L = profiles["image"].layers
    gpipe, full = step("gpipe", None), step(RECOMPUTE, None)
    assert step(RECOMPUTE, L) == pytest.approx(full)
    assert step(RECOMPUTE, 0) == pytest.approx(gpipe)
    ks = [step(RECOMPUTE, k) for k in (0, 6, 12, 18, L)]
    assert all(a[0] < b[0] and a[1] > b[1] for a, b in zip(ks, ks[1:]))


def test_a_partial_recompute_is_written_into_the_runtime_plan_and_read_back():
    """The runtime recomputes the first N blocks of each stage (``recompute: N``): the plan written
    holds the count the cost model priced, and pricing the plan gives the same choice back."""
    from lightning_distmm.planner.cost import RECOMPUTE, TowerChoice
    from lightning_distmm.planner.cost.plans import tower_choice, tower_plan

    ch = TowerChoice("image", 8, 1, 1, 64, RECOMPUTE, (64,) * 8, "none", 4)
    tower = tower_plan(ch, list(range(8)))
    assert tower.schedule == "gpipe" and tower.recompute == 4 and tower.recompute is not True
    assert tower_choice("image", tower, 512).recompute_layers == 4
    whole = tower_plan(TowerChoice("image", 8, 1, 1, 64, RECOMPUTE, (64,) * 8), list(range(8)))
    assert whole.recompute is True and tower_choice("image", whole, 512).recompute_layers is None


def test_megatron_tp_pp_is_the_model_parallel_family_the_paper_implies():
    """``megatron-tp-pp``: uniform tp x pp >= 2 on every tower (the text tower at the image tower's
    degrees), one microbatch per pipeline, ZeRO-1; never slower to find than ``megatron`` allows it to
    be faster (``megatron`` may pick pure data parallelism, this family may not)."""
    _, rep = make_plan(model("clip_vit_g14"), "a100_8x8", 4096, ALL_SHARDS)
    fam, meg = rep.baselines["megatron-tp-pp"], rep.baselines["megatron"]
    assert fam is not None and meg is not None
    degrees = {(c.tp, c.pp) for c in fam.choices.values()}
    assert len(degrees) == 1 and next(iter(degrees))[0] * next(iter(degrees))[1] >= 2
    assert all(c.K == 1 and c.shard == "optimizer" for c in fam.choices.values())
    assert meg.step_time <= fam.step_time
    print(f"megatron {describe(meg)}; megatron-tp-pp {describe(fam)}: {fam.step_time / meg.step_time:.2f}x slower")


def test_megatron_is_priced_with_sequence_parallelism_under_tensor_parallelism():
    """Megatron-LM runs --sequence-parallel with TP: the norms, residual adds and their activations
    are split over the tp ranks. The megatron baselines are priced so; DDP, FSDP and DistMM are not
    (the runtime has no sequence parallelism), and a plan priced with it never joins DistMM's pool."""
    from lightning_distmm.planner.cost import block_times
    from lightning_distmm.planner.cost.memory import act_per_sample
    from lightning_distmm.planner.search.baselines import baseline_options

    o = CostOptions()
    assert baseline_options("megatron", o).sequence_parallel and baseline_options("megatron-tp-pp", o).sequence_parallel
    assert not baseline_options("fsdp", o).sequence_parallel and not baseline_options("ddp", o).sequence_parallel
    sp = baseline_options("megatron", o)
    p = model_profiles(model("clip_vit_bigg14"))["image"]
    cl = load_cluster("a100_8x8")
    for tp in (2, 4, 8):
        assert act_per_sample(p, sp, tp, 1) < act_per_sample(p, o, tp, 1)
        assert float(block_times(p.layer, cl, sp, 16, tp)[0]) < float(block_times(p.layer, cl, o, 16, tp)[0])
    assert act_per_sample(p, sp, 1, 1) == act_per_sample(p, o, 1, 1)
    _, rep = make_plan(model("clip_vit_bigg14"), "a100_8x8", 4096, ALL_SHARDS)
    if rep.picked_baseline() in ("megatron", "megatron-tp-pp"):
        # Megatron-LM's own plan may be picked (ZeRO-1 runs), but only where sp changes nothing: tp 1
        assert all(ch.tp == 1 for ch in rep.chosen.choices.values()), describe(rep.chosen)


def test_fsdp_pays_a_collective_latency_per_layer():
    """FSDP all-gathers and reduce-scatters layer by layer: the stage's gather is ``layers`` gathers of
    one layer's bytes, each with NCCL's latency, slower than one gather of all the bytes would be."""
    from lightning_distmm.planner.cost import allgather_time, shard_comm
    from lightning_distmm.planner.cost.comm import _compact_dp_groups
    from lightning_distmm.planner.cost.memory import stage_params

    cl = load_cluster("a100_8x8")
    p = model_profiles(model("clip_vit_l14"))["text"]
    o = CostOptions()
    ag, _ = shard_comm(p, cl, o, 64, 1, 1)
    nodes, per_node, groups = _compact_dp_groups(cl, 64, 1, 1)
    total = stage_params(p, 1, 1) * o.policy.weights
    m = max(float(nodes), 1)

    def one(nbytes: float) -> float:
        return float(allgather_time(cl, nbytes, 64.0, nodes, per_node, groups * (m - 1) / m * nbytes))

    assert float(ag) == pytest.approx(p.layers * one(total / p.layers))
    assert float(ag) > one(total)


def test_zero2_gathers_weights_once_and_the_planner_may_write_it():
    """ZeRO-2 (FSDP2 reshard_after_forward=False): the forward all-gathers each layer, the backward
    only reduce-scatters (ZeRO-3 gathers again). The runtime runs it (``shard: zero2``), so the
    planner may write it when the options list it, and the fsdp baseline's ZeRO-2 plan is then in the
    search's pool: the search is never priced slower than it."""
    from lightning_distmm.planner.cost import shard_comm

    cl = load_cluster("a100_8x8")
    p = model_profiles(model("clip_vit_l14"))["image"]
    o = CostOptions()
    ag3, bwd3 = (float(x) for x in shard_comm(p, cl, o, 64, 1, 1, "full"))
    ag2, bwd2 = (float(x) for x in shard_comm(p, cl, o, 64, 1, 1, "zero2"))
    assert ag2 == pytest.approx(ag3) and bwd2 == pytest.approx(bwd3 - ag3)
    plan, report = make_plan(model("clip_vit_l14"), "a100_8x8", 1024, {"shards": ["none", "zero2", "full"]})
    assert {t.shard for t in plan.towers.values()} <= {"none", "zero2", "full"}
    fsdp = report.baselines["fsdp"]
    assert fsdp is not None and report.step_time <= fsdp.step_time * (1 + 1e-9)
