"""The cost model against published CLIP training throughputs (conf/published/clip_training.yaml;
docs/planner.md, "Published measurements"). Every entry is priced as its source ran it; an entry
marked reached must be predicted within +-25%, one marked unreached must still be out (a model
change that reaches it has to move it), and the ratios are printed (`pytest -s`, or
`python benchmarks/planner.py --published`)."""

from __future__ import annotations

import pytest

from lightning_distmm.planner.cost import RECOMPUTE
from lightning_distmm.planner.published import (
    TOLERANCE,
    PublishedSet,
    load_published,
    predict,
    predict_all,
    run_choices,
    table,
)


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
    """The issue's target: every entry within +-25%. Today no entry is reached (the printed table says
    by how much and why); an entry marked reached must be within, one marked unreached must be out."""
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
    # the model is optimistic, never pessimistic: every prediction is above its measurement
    assert all(p.ratio > 1 for p in predictions)


def test_partial_recompute_is_priced_between_none_and_all_layers(data: PublishedSet) -> None:
    """NeMo's g/14 recomputes 8 of its 40 vision blocks: the priced step lies 8/40 of the way from
    no recomputation to recomputing the whole tower, and the 264-token vision sequence (256 patches
    and NeMo's 8 class tokens) is what is priced."""
    from lightning_distmm.planner.cost import CostOptions, evaluate_plan
    from lightning_distmm.planner.profile import model_profiles

    e = next(x for x in data.entries if x.key == "nemo_g14_a100_1n")
    run = data.models[e.model]
    profiles = model_profiles(run.config())
    assert profiles["image"].seq == 264 and profiles["text"].seq == 80 and profiles["image"].heads == 22
    p = predict(e, run)
    cl, opts = p.cluster, CostOptions(precision=run.precision, flash_attention=run.flash_attention)
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
