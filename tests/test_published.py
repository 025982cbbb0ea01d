"""The cost model against published CLIP training throughputs (conf/published/clip_training.yaml;
docs/planner-results.md, "Published measurements"). Every entry is priced as its source ran it; an entry
marked reached must be predicted within +-25%, one marked unreached must still be out (a model
change that reaches it has to move it), and the ratios are printed (`pytest -s`, or
`python benchmarks/planner.py --published`)."""

from __future__ import annotations

from pathlib import Path

import pytest
from forked_main import script_module

from lightning_distmm.planner.cost import RECOMPUTE

published = script_module(Path(__file__).resolve().parents[1] / "benchmarks" / "published.py")
TOLERANCE = published.TOLERANCE
PublishedSet = published.PublishedSet
load_published = published.load_published
predict = published.predict
predict_all = published.predict_all
run_choices = published.run_choices
run_options = published.run_options
table = published.table


@pytest.fixture(scope="module")
def data() -> PublishedSet:
    return load_published()


@pytest.fixture(scope="module")
def predictions(data: PublishedSet) -> list:
    return predict_all(data)


def test_the_file_round_trips_through_yaml_and_names_its_sources(data: PublishedSet) -> None:
    again = PublishedSet.from_yaml(data.to_yaml())
    assert again.to_dict() == data.to_dict()
    for e in data.entries:
        assert e.source in data.sources and e.model in data.models
        assert e.gpus > 0 and e.per_gpu_batch > 0 and e.samples_per_s > 0
        assert e.reached or e.reason in data.reasons
    keys = {e.source for e in data.entries}
    assert {"nemo_perf", "laion_csv"} <= keys
    nemo = [e.samples_per_s for e in data.entries if e.source == "nemo_perf" and e.cluster == "dgx_a100"]
    assert nemo == [559, 1115, 2190, 4407, 8633]
    nemo_h = [e.samples_per_s for e in data.entries if e.source == "nemo_perf" and e.cluster == "dgx_h100"]
    assert nemo_h == [935, 1795, 3502, 6771, 13829]


def test_an_entry_without_its_source_or_reason_is_refused(data: PublishedSet) -> None:
    raw = data.to_dict()
    raw["entries"][0] = {**raw["entries"][0], "source": "nowhere"}
    with pytest.raises(ValueError, match="no source 'nowhere'"):
        PublishedSet.from_dict(raw)
    raw = data.to_dict()
    raw["entries"][0] = {**raw["entries"][0], "reached": False, "reason": "unexplained"}
    with pytest.raises(ValueError, match="without a reason"):
        PublishedSet.from_dict(raw)


def test_every_published_measurement_is_predicted_within_25_percent_or_marked_with_its_reason(
    data: PublishedSet, predictions: list
) -> None:
    """The target: every entry within +-25%. The printed table says which entries are reached and, for
    the others, by how much they are off and why; an entry marked reached must be within, one marked
    unreached must be out."""
    print()
    print(table(predictions, data.reasons))
    reached = [p for p in predictions if p.entry.reached]
    print(f"\n{sum(p.within for p in predictions)} of {len(predictions)} entries within +-{TOLERANCE:.0%}")
    for p in reached:
        assert p.within, f"{p.entry.key}: predicted {p.ratio:.2f}x the measurement, outside +-{TOLERANCE:.0%}"
    for p in predictions:
        if not p.entry.reached:
            assert not p.within, (
                f"{p.entry.key} is now predicted within +-{TOLERANCE:.0%} ({p.ratio:.2f}x): mark it reached in"
                " conf/published/clip_training.yaml"
            )
    # what the model misses it misses on the optimistic side: every entry out of reach is predicted
    # faster than measured (something the sources do not state slowed them down)
    assert all(p.ratio > 1 + TOLERANCE for p in predictions if not p.within)


def test_partial_recompute_is_priced_between_none_and_all_layers(data: PublishedSet) -> None:
    """NeMo's g/14 recomputes 8 of its 40 vision blocks: the priced step lies 8/40 of the way from
    no recomputation to recomputing the whole tower, and the 264-token vision sequence (256 patches
    and NeMo's 8 class tokens) is what is priced."""
    from lightning_distmm.planner.cost import evaluate_plan
    from lightning_distmm.planner.profiles.profile import model_profiles

    e = next(x for x in data.entries if x.key == "nemo_g14_a100_1n")
    run = data.models[e.model]
    profiles = model_profiles(run.config())
    assert profiles["image"].seq == 264 and profiles["text"].seq == 80 and profiles["image"].heads == 22
    p = predict(e, run)
    cl, opts = p.cluster, run_options(run)
    ranks = {n: list(range(8)) for n in profiles}
    none = evaluate_plan(profiles, cl, opts, run_choices(profiles, 8, 80, False), ranks, 640).step_time
    full_choices = run_choices(profiles, 8, 80, "image")
    assert full_choices["image"].schedule == RECOMPUTE and full_choices["text"].schedule == "gpipe"
    full = evaluate_plan(profiles, cl, opts, full_choices, ranks, 640).step_time
    assert p.step_time == pytest.approx(none + 8 / 40 * (full - none))
    assert none < p.step_time < full


def test_the_source_configuration_is_priced_not_the_planners_choice(data: PublishedSet) -> None:
    """Unfused attention (the sources' kernels) and autocast's fp32 residual stream each slow the
    priced step: the prediction is of the run as it was made."""
    import dataclasses

    e = next(x for x in data.entries if x.key == "laion_l14_2b_s32b_b82k")
    run = data.models[e.model]
    assert not run.flash_attention
    fused = predict(e, dataclasses.replace(run, flash_attention=True))
    assert predict(e, run).step_time > fused.step_time


def test_nemo_runs_are_priced_with_what_nemos_configuration_and_code_state(data: PublishedSet) -> None:
    """NeMo's CLIP (the launcher's configurations, megatron_clip_models.py): bf16 O2 moves 2-byte
    residuals and casts nothing (faster than autocast), the fp32 gradient all-reduce runs after the
    backward (slower than overlapped), and Megatron's linears add biases in their own kernels (slower
    than the GEMM epilogue). Each term moves the priced step the way the source says, and the file
    keeps all three for every NeMo model."""
    import dataclasses

    for key in ("nemo_g14", "nemo_h14", "nemo_b32"):
        run = data.models[key]
        assert not run.autocast and not run.overlap_grad_sync and run.separate_bias and not run.flash_attention
        assert run.torch_softmax == ("image",)  # the ViT passes no mask; the text tower's causal one is fused
    e = next(x for x in data.entries if x.key == "nemo_g14_a100_4n")
    run = data.models[e.model]
    step = predict(e, run).step_time
    assert predict(e, dataclasses.replace(run, autocast=True)).step_time > step
    assert predict(e, dataclasses.replace(run, overlap_grad_sync=True)).step_time < step
    assert predict(e, dataclasses.replace(run, separate_bias=False)).step_time < step
    assert predict(e, dataclasses.replace(run, torch_softmax=())).step_time < step
    # the comparative table's g/14 H100 row and the scaling table's 4-node H100 figure disagree by
    # 1.64x: one configuration cannot be within 25% of both, and the file says which one it reaches
    cmp_ = next(x for x in data.entries if x.key == "nemo_g14_h100_4n_cmp")
    scal = next(x for x in data.entries if x.key == "nemo_g14_h100_4n")
    assert cmp_.samples_per_s / scal.samples_per_s == pytest.approx(1.64, abs=0.01)
    assert cmp_.reached and not scal.reached


def test_separate_bias_kernels_cost_the_bytes_they_move() -> None:
    """Megatron's bias handling priced from bytes: a column-parallel GEMM's bias is one read and one
    write of its output in the forward, every bias gradient one read of the output gradient; for a
    ViT block (qkv and fc1 column-parallel, proj and fc2 row-parallel) that is (3h + m) x 2 x 2 bytes
    forward and (5h + m) x 2 bytes backward per token in bf16."""
    from lightning_distmm.planner.cost import CostOptions
    from lightning_distmm.planner.cost.compute import block_times
    from lightning_distmm.planner.measure.local import load_cluster
    from lightning_distmm.planner.profiles.profile import model_profiles

    cl = load_cluster("dgx_a100")
    prof = model_profiles(data_model := load_published().models["nemo_h14"].config())["image"]
    assert data_model["towers"]["image"]["heads"] == 20
    mb, s, h, m = 112, prof.seq, prof.width, prof.layer.gemms[2].n
    base = CostOptions(flash_attention=False, autocast=False)
    f0, b0 = block_times(prof.layer, cl, base, mb, 1)
    f1, b1 = block_times(prof.layer, cl, CostOptions(flash_attention=False, autocast=False, separate_bias=True), mb, 1)
    bw = cl.device.stream_bandwidth
    assert float(f1 - f0) == pytest.approx(mb * s * (3 * h + m) * 2 * 2 / bw, rel=1e-6)
    assert float(b1 - b0) == pytest.approx(mb * s * (5 * h + m) * 2 / bw, rel=1e-6)


def test_an_fp32_torch_softmax_costs_its_extra_passes_over_the_scores() -> None:
    """NeMo's ViT softmax as PyTorch ops in fp32 (cast, scale, softmax, cast back): 24 bytes per
    score element forward and 28 - 2 backward beyond the fused kernel's passes, over the HBM
    streaming bandwidth; only for the towers named, only without FlashAttention."""
    from lightning_distmm.planner.cost import CostOptions
    from lightning_distmm.planner.cost.compute import TORCH_SOFTMAX_BYTES, stage_compute
    from lightning_distmm.planner.measure.local import load_cluster
    from lightning_distmm.planner.profiles.profile import model_profiles

    assert TORCH_SOFTMAX_BYTES == (24.0, 28.0)
    cl = load_cluster("dgx_a100")
    profs = model_profiles(load_published().models["nemo_g14"].config())
    img, txt = profs["image"], profs["text"]
    mb = 80
    plain = CostOptions(flash_attention=False, autocast=False)
    torch_sm = CostOptions(flash_attention=False, autocast=False, torch_softmax_towers=("image",))
    f0, b0 = stage_compute(img, cl, plain, mb, 1, 1)
    f1, b1 = stage_compute(img, cl, torch_sm, mb, 1, 1)
    scores = img.layers * mb * 22 * 264 * 264
    bw = cl.device.stream_bandwidth
    assert float(f1 - f0) == pytest.approx(scores * 24 / bw, rel=1e-6)
    assert float(b1 - b0) == pytest.approx(scores * 26 / bw, rel=1e-6)
    assert stage_compute(txt, cl, torch_sm, mb, 1, 1) == stage_compute(txt, cl, plain, mb, 1, 1)
    flash = CostOptions(flash_attention=True, autocast=False, torch_softmax_towers=("image",))
    assert stage_compute(img, cl, flash, mb, 1, 1) == stage_compute(img, cl, CostOptions(autocast=False), mb, 1, 1)


def test_laions_stability_runs_are_priced_with_the_gradient_checkpointing_their_blog_states(data: PublishedSet) -> None:
    """LAION's blog ("Training speeds": A100-40GB, "We used gradient checkpointing") gives the
    configuration of the stability.ai runs: every block of both towers recomputed, which slows the
    priced H/14 step; its per-GPU rates are the CSV's (42 x 824 = 34,608 samples/s)."""
    import dataclasses

    e = next(x for x in data.entries if x.key == "laion_h14_2b_s32b_b79k")
    run = data.models[e.model]
    assert run.source == "laion_blog" and e.samples_per_s == 42 * 824
    profiles_layers = {"image": 32, "text": 24}
    assert dict(run.recompute_layers) == profiles_layers
    assert predict(e, run).step_time > predict(e, dataclasses.replace(run, recompute_layers={})).step_time
    blog = [x for x in data.entries if x.source == "laion_blog"]
    assert sorted(x.samples_per_s for x in blog) == [20 * 800, 30 * 824]
