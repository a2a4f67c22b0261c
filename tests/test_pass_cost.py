"""The weights of a step budget's tokens (ragkv.engine.pass_cost), against the multiply-adds
counted by hand from the model's shapes, and the piece sizes they give."""

from __future__ import annotations

import pytest
from transformers import Gemma3TextConfig, LlamaConfig

from ragkv.engine.model_spec import ModelSpec
from ragkv.engine.pass_cost import PassCost


def smollm2_shapes() -> ModelSpec:
    config = LlamaConfig(
        hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3
    )
    return ModelSpec.from_hf_config(config)


def test_the_context_scale_is_the_weights_multiply_adds_over_attentions_per_row():
    # per layer and token: q 576x576, k and v 576x192 each, o 576x576, gate/up/down 3 x 576x1536;
    # attention per context row: QK and PV over 9 heads of 64
    weights = 576 * 576 * 2 + 576 * 192 * 2 + 3 * 576 * 1536
    assert PassCost.of(smollm2_shapes()).context_scale == pytest.approx(weights / (2 * 9 * 64))


def test_sliding_window_layers_see_at_most_their_window():
    config = Gemma3TextConfig(
        hidden_size=640, intermediate_size=2048, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=1,
        head_dim=256, sliding_window=512, layer_types=["sliding_attention"] * 5 + ["full_attention"],
    )  # fmt: skip
    cost = PassCost.of(ModelSpec.from_hf_config(config))
    assert cost.windowed_share == pytest.approx(5 / 6) and cost.window == 512
    scale = cost.context_scale
    assert cost.cost(10, 4000) == pytest.approx(10 * (1 + (4000 / 6 + 512 * 5 / 6) / scale))
    assert cost.cost(10, 100) == pytest.approx(10 * (1 + 100 / scale))


@pytest.mark.parametrize("start", [0, 1000, 6000])
def test_a_piece_is_the_most_tokens_whose_cost_fits(start):
    cost = PassCost(context_scale=3072)
    tokens = cost.tokens_within(504, start)
    assert cost.cost(tokens, start + tokens / 2) <= 504 < cost.cost(tokens + 1, start + (tokens + 1) / 2)


def test_late_pieces_are_shorter_and_none_is_empty():
    cost = PassCost(context_scale=3072)
    sizes = [cost.tokens_within(504, start) for start in (0, 2000, 6000)]
    assert sizes == sorted(sizes, reverse=True) and sizes[0] < 504
    assert cost.tokens_within(0.5, 10_000) == 1
    assert PassCost(context_scale=float("inf")).tokens_within(504, 6000) == 504


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="context_scale"):
        PassCost(context_scale=0)
    with pytest.raises(ValueError, match="windowed_share"):
        PassCost(context_scale=1, windowed_share=2)
