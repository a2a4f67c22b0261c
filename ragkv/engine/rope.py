"""Rotary position embedding for every RoPE variant the supported checkpoints use.

Keys are stored before rotation, so position recovery after concatenating chunks is a
plain application of this module at the chunk's new global positions: exact for all
variants, because each one is a fixed per-frequency rotation of position p.
"""

from __future__ import annotations

import math

import torch

from ragkv.engine.model_spec import RopeSpec
from ragkv.kernels.rope import apply_rope


def _default_inv_freq(spec: RopeSpec) -> torch.Tensor:
    dim = int(spec.head_dim * spec.params.get("partial_rotary_factor", 1.0))
    return 1.0 / (spec.theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))


def _linear(spec: RopeSpec) -> tuple[torch.Tensor, float]:
    return _default_inv_freq(spec) / float(spec.params["factor"]), 1.0


def _llama3(spec: RopeSpec) -> tuple[torch.Tensor, float]:
    inv_freq = _default_inv_freq(spec)
    factor = float(spec.params["factor"])
    low_freq_factor = float(spec.params["low_freq_factor"])
    high_freq_factor = float(spec.params["high_freq_factor"])
    original_context = float(spec.params["original_max_position_embeddings"])
    low_freq_wavelen = original_context / low_freq_factor
    high_freq_wavelen = original_context / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (original_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled), 1.0


def _yarn(spec: RopeSpec) -> tuple[torch.Tensor, float]:
    params = spec.params
    dim = int(spec.head_dim * params.get("partial_rotary_factor", 1.0))
    original_context = params.get("original_max_position_embeddings") or spec.max_position_embeddings
    factor = params.get("factor") or spec.max_position_embeddings / original_context

    def mscale(scale: float, coefficient: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * coefficient * math.log(scale) + 1.0

    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        if params.get("mscale") and params.get("mscale_all_dim"):
            attention_factor = mscale(factor, params["mscale"]) / mscale(factor, params["mscale_all_dim"])
        else:
            attention_factor = mscale(factor)
    beta_fast = params.get("beta_fast") or 32
    beta_slow = params.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original_context / (rotations * 2 * math.pi)) / (2 * math.log(spec.theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    extrapolation_weight = 1 - ramp
    pos_freqs = spec.theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation_weight) + (1.0 / pos_freqs) * extrapolation_weight
    return inv_freq, float(attention_factor)


_VARIANTS = {
    "default": lambda spec: (_default_inv_freq(spec), 1.0),
    "linear": _linear,
    "llama3": _llama3,
    "yarn": _yarn,
}


class Rotary:
    """Computes cos/sin tables for positions and rotates [heads, tokens, head_dim] tensors."""

    def __init__(self, spec: RopeSpec, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32):
        if spec.rope_type not in _VARIANTS:
            raise ValueError(f"unsupported RoPE type {spec.rope_type!r}; supported: {sorted(_VARIANTS)}")
        inv_freq, attention_scaling = _VARIANTS[spec.rope_type](spec)
        # transformers computes inv_freq in float32; matching it keeps logits bit-close.
        self.inv_freq = inv_freq.to(torch.float32).to(device)
        self.attention_scaling = attention_scaling
        self.rotary_dim = 2 * self.inv_freq.numel()
        self.head_dim = spec.head_dim
        self.dtype = dtype
        if self.rotary_dim != self.head_dim:
            raise ValueError("partial rotary embeddings are not supported by the supported families")

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[T] integer positions -> cos, sin of shape [T, head_dim] with attention scaling folded in."""
        freqs = positions.to(torch.float32)[:, None] * self.inv_freq[None, :]
        angles = torch.cat((freqs, freqs), dim=-1)
        cos = (angles.cos() * self.attention_scaling).to(self.dtype)
        sin = (angles.sin() * self.attention_scaling).to(self.dtype)
        return cos, sin

    def rotate(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Rotate pre-RoPE x [heads, T, head_dim] to the given absolute positions [T]."""
        cos, sin = self.cos_sin(positions)
        return apply_rope(x, cos, sin)
