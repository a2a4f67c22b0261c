"""ragkv's RoPE variants against transformers' own RoPE initialisation functions, and the
exactness of position recovery from pre-RoPE keys."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from ragkv.engine.model_spec import ModelSpec
from ragkv.engine.rope import Rotary

VARIANTS = {
    "default": {"rope_type": "default", "rope_theta": 10000.0},
    "linear": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
    "llama3": {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
    "yarn": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 4096},
    "yarn-mscale": {
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 40.0,
        "mscale": 1.0,
        "mscale_all_dim": 0.5,
        "original_max_position_embeddings": 4096,
        "beta_fast": 16,
        "beta_slow": 2,
    },
}


def _config(parameters: dict) -> LlamaConfig:
    return LlamaConfig(
        hidden_size=512,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=32768,
        rope_parameters=dict(parameters),
    )


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_inv_freq_and_scaling_match_transformers(variant):
    config = _config(VARIANTS[variant])
    rotary = Rotary(ModelSpec.from_hf_config(config).rope)
    compute = ROPE_INIT_FUNCTIONS[config.rope_parameters["rope_type"]] if variant != "default" else None
    if compute is None:
        expected = 1.0 / (10000.0 ** (torch.arange(0, 64, 2, dtype=torch.float32) / 64))
        scaling = 1.0
    else:
        expected, scaling = compute(config, "cpu")
    torch.testing.assert_close(rotary.inv_freq, expected.float(), rtol=1e-6, atol=0)
    assert rotary.attention_scaling == pytest.approx(scaling)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_position_recovery_is_exact(variant):
    """Keys rotated at local positions, un-rotated and re-rotated to global positions equal
    keys rotated at the global positions directly (what fusion relies on)."""
    rotary = Rotary(ModelSpec.from_hf_config(_config(VARIANTS[variant])).rope, dtype=torch.float32)
    pre_rope = torch.randn(3, 50, 64, dtype=torch.float32)
    global_positions = torch.arange(1000, 1050)
    direct = rotary.rotate(pre_rope, global_positions)
    local = rotary.rotate(pre_rope, torch.arange(50))
    cos, sin = rotary.cos_sin(torch.arange(50))
    scale = rotary.attention_scaling**2
    unrotated = (local * cos + torch.cat((local[..., 32:], -local[..., :32]), -1) * sin) / scale
    torch.testing.assert_close(rotary.rotate(unrotated, global_positions), direct, rtol=1e-4, atol=1e-4)


def test_rotation_preserves_relative_scores():
    """q·k after RoPE depends only on the position difference (the property WRoPE and
    position recovery use)."""
    rotary = Rotary(ModelSpec.from_hf_config(_config(VARIANTS["default"])).rope, dtype=torch.float32)
    generator = torch.Generator().manual_seed(0)
    q, k = torch.randn(1, 1, 64, generator=generator), torch.randn(1, 1, 64, generator=generator)
    near = (rotary.rotate(q, torch.tensor([110])) * rotary.rotate(k, torch.tensor([100]))).sum()
    far = (rotary.rotate(q, torch.tensor([5010])) * rotary.rotate(k, torch.tensor([5000]))).sum()
    # float32 angles at position 5000 carry ~5e-4 rad of rounding.
    torch.testing.assert_close(near, far, rtol=2e-3, atol=2e-3)


def test_unknown_rope_type_is_refused():
    config = _config({"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0})
    with pytest.raises(ValueError, match="unsupported RoPE type"):
        Rotary(ModelSpec.from_hf_config(config).rope)
