"""The VLM planner's model sizes: the parameter counts of transformers models built on the meta device match
the published sizes (LLaVA-1.5-7B: CLIP ViT-L/14-336 + Vicuna-7B; InternVL: InternViT-6B + InternLM2-20B)."""

from __future__ import annotations

import pytest

from lightning_distmm.planner.vlm.sizes import PRESETS, count_on_meta


@pytest.mark.parametrize("name", list(PRESETS))
def test_counts_match_published_sizes(name: str) -> None:
    preset = PRESETS[name]
    counts = count_on_meta(preset)
    for part, published in preset.published.items():
        assert counts[part] == pytest.approx(published, rel=0.01), (part, counts[part])
    assert counts["projector"] < 0.02 * counts["llm"]


def test_llava_projector_and_tokens() -> None:
    counts = count_on_meta(PRESETS["llava15_7b"])
    assert counts["projector"] == 1024 * 4096 + 4096 + 4096 * 4096 + 4096  # two linear layers with biases
    assert PRESETS["llava15_7b"].tokens_per_image == (336 // 14) ** 2
