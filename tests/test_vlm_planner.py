"""The VLM planner (a vision encoder feeding an LLM) (planner/vlm/profile.py, planner/vlm/search.py):
profiles against transformers' parameter counts, the images-per-sample distribution, the pipeline
replay, and the search against its baselines on a small cluster."""

from __future__ import annotations

import dataclasses

import pytest

from lightning_distmm.core.handoff_schedule import handoff_schedules
from lightning_distmm.core.plan import Plan
from lightning_distmm.core.schedule import Forward
from lightning_distmm.planner.cost.options import CostOptions
from lightning_distmm.planner.cost.simulate import simulate_handoff
from lightning_distmm.planner.measure.local import load_cluster
from lightning_distmm.planner.vlm.profile import WORKLOADS, VLMWorkload, straggler, vlm_profiles
from lightning_distmm.planner.vlm.search import ModuleChoice, price_module, vlm_plan
from lightning_distmm.planner.vlm.sizes import PRESETS, count_on_meta


@pytest.mark.parametrize("name", list(WORKLOADS))
def test_profiles_count_the_parameters_transformers_builds(name: str) -> None:
    profs, counts = vlm_profiles(WORKLOADS[name]), count_on_meta(PRESETS[name])
    assert profs.llm.params == counts["llm"]  # Llama layer by layer: GQA, SwiGLU, RMSNorm, untied head
    assert profs.vision.params == pytest.approx(counts["vision"], rel=1e-5)  # (CLIP's pre-LayerNorm: 2 x width)
    # InternVL's projector normalises its pixel-shuffled input first (a LayerNorm the meta build omits)
    assert profs.projector.params - counts["projector"] in (0, 2 * PRESETS[name].projector[0])


def test_llm_sequence_and_flops_follow_the_images() -> None:
    w = WORKLOADS["llava15_7b"]
    profs = vlm_profiles(w)
    assert profs.llm.seq == round(512 + 0.9 * 576)
    # GEMM FLOPs are 2 x (weights outside the embeddings and norms) x tokens; attention comes on top
    p = profs.llm
    gemm_weights = p.layers * (p.layer.params - 2 * p.width) + p.post.params - p.width
    assert p.flops_per_sample() > 2 * gemm_weights * p.seq
    assert p.flops_per_sample() < 1.2 * 2 * gemm_weights * p.seq
    more = vlm_profiles(dataclasses.replace(w, images={2: 1.0}))
    assert more.llm.seq == 512 + 2 * 576 and more.tokens_per_row == 2 * 576


def test_straggler_is_the_expected_largest_replica_load() -> None:
    half = VLMWorkload("llava15_7b", images={0: 0.5, 2: 0.5})
    # one row per replica, two replicas: the larger of two draws of {0, 2} is 2 unless both are 0
    assert straggler(half, 1, 2) == pytest.approx(2 * 0.75 / 1.0)
    assert straggler(half, 1, 1) == 1.0 and straggler(WORKLOADS["internvl_26b"], 8, 1) == 1.0
    assert straggler(VLMWorkload("llava15_7b", images={1: 1.0}), 4, 8) == 1.0
    # tokens: the text part does not vary, so the excess is smaller
    tokens = straggler(half, 1, 2, tokens_per_image=100, text=100)
    assert tokens == pytest.approx((100 + 1.5 * 100) / (100 + 100))
    # more rows per replica average the draws out
    assert straggler(half, 64, 8) < straggler(half, 4, 8) < straggler(half, 1, 8)


def test_workload_yaml_round_trip_and_checks() -> None:
    w = WORKLOADS["internvl_26b"]
    assert VLMWorkload.from_yaml(w.to_yaml()) == w
    with pytest.raises(ValueError, match="sum to 1"):
        VLMWorkload("llava15_7b", images={1: 0.5})
    with pytest.raises(ValueError, match="preset"):
        VLMWorkload("llava_nope")


def test_memory_decides_what_fits() -> None:
    profs, cluster, opts = vlm_profiles(WORKLOADS["llava15_7b"]), load_cluster("a100_8x8"), CostOptions()
    # a whole 7B LLM's weights, gradients and Adam state on one 80 GB device: no
    assert price_module(profs, ModuleChoice("llm", 1), 8, cluster, opts) is None
    # split 8 ways by tensor parallelism: yes
    assert price_module(profs, ModuleChoice("llm", 8, tp=8), 8, cluster, opts) is not None
    # the frozen ViT has no backward of its own: the image module's backward is the projector's
    image = price_module(profs, ModuleChoice("image", 1), 8, cluster, opts)
    assert image is not None and 0 < image.b < 0.25 * image.f


def test_replay_waits_for_the_previous_pipeline_stage() -> None:
    """An LLM in two stages (ranks 1, 2): stage 1's forward of a microbatch starts after stage 0's ends."""
    plan = Plan(3, {"image": {"ranks": [0]}, "llm": {"ranks": [1, 2], "pp": 2, "microbatch": 2}}, 4)
    lists = handoff_schedules(plan, {"llm": ["image"]}, ["image", "llm"], {"image": True, "llm": True}, 4)
    out = simulate_handoff(lists, lambda r, ins: 1.0, 0.5, {"llm": [2]})
    fwd = {
        (i.rank, i.instruction.mb): i
        for i in out
        if isinstance(i.instruction, Forward) and i.instruction.tower == "llm"
    }
    for mb in (0, 1):
        assert fwd[2, mb].start >= fwd[1, mb].end + 0.5


def test_search_on_a_small_cluster_picks_no_worse_than_fsdp() -> None:
    cluster = load_cluster("h100_8x8").with_world(16)
    out = vlm_plan(vlm_profiles(WORKLOADS["llava15_7b"]), cluster, 32, keep=2)
    pick, fsdp, meg = out["distmm"], out["fsdp"], out["megatron"]
    assert pick is not None and fsdp is not None and meg is not None
    assert pick.step <= fsdp.step and pick.step <= min(p.step for p in (out["separate"], out["colocated"]) if p)
    for p in out.values():
        if p is None:
            continue
        assert p.plan.world_size == 16 and p.plan.global_batch == 32
        assert Plan.from_yaml(p.plan.to_yaml()).to_dict() == p.plan.to_dict()
        assert max(p.memory) <= cluster.device.memory
    assert fsdp.image.shard == fsdp.llm.shard == "full" and fsdp.llm.tp == fsdp.llm.pp == 1
    assert meg.image.tp == meg.llm.tp
    sep = out["separate"]
    if sep is not None:
        assert not set(sep.plan.towers["image"].ranks) & set(sep.plan.towers["llm"].ranks)
    # a colocated plan without microbatches runs the modules one after the other: the replay is the closed form
    if fsdp.image.microbatches == fsdp.llm.microbatches == 1:
        assert fsdp.step == pytest.approx(fsdp.estimate, rel=1e-6)


def test_balanced_straggler_is_the_runtime_assignments():
    """``balance: cost`` prices the straggler of each step's cost-balanced rows: no worse than the
    even split, the same at one row per replica (nothing can move), and within a few percent of what
    the runtime's own assignment (``core.assignment.balance_rows``) gives on drawn batches."""
    import random

    from lightning_distmm.core.assignment import balance_rows, loads

    w = WORKLOADS["internvl_26b"]
    for rows, dp in ((1, 16), (2, 16), (4, 16), (8, 8)):
        even, balanced = straggler(w, rows, dp), straggler(w, rows, dp, balanced=True)
        assert balanced <= even + 1e-9
        if rows == 1:
            assert balanced == pytest.approx(even, rel=0.02)
        else:
            plan = Plan(dp, {"image": {"ranks": list(range(dp))}})
            rng = random.Random(5)
            got = []
            for _ in range(64):
                cost = [float(c) for c in rng.choices(list(w.images), list(w.images.values()), k=rows * dp)]
                got.append(max(loads(balance_rows(plan, rows * dp, {"image": cost}), plan, "image", cost)))
            runtime = sum(got) / len(got) / (rows * w.mean_images)
            assert balanced == pytest.approx(runtime, rel=0.05)
    cost = dataclasses.replace(w, balance="cost")
    assert straggler(cost, 4, 16) == straggler(w, 4, 16, balanced=True) < straggler(w, 4, 16)
    assert VLMWorkload.from_yaml(cost.to_yaml()) == cost
    with pytest.raises(ValueError, match="balance 'tokens'"):
        dataclasses.replace(w, balance="tokens")
