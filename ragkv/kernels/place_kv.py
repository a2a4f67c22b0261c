"""Write a chunk's stored K/V into its rows of the runtime cache, dequantising on the way.

Keys are stored before RoPE; placing them rotates them to their global positions. For
quantised chunks the dequantisation is fused into that step: each token group's codes
are unpacked into the two rotate-half halves, scaled, rotated and written straight into
the cache slice, so no full-size float copy of the chunk is made first. Float chunks
take the plain RoPE kernel (:func:`kernels.apply_rope`).
"""

from __future__ import annotations

import torch

from ragkv.kernels.checks import FLOAT_DTYPES, check_dtype, check_shape, require
from ragkv.kernels.kv_quant import QuantizedKV, code_halves
from ragkv.kernels.rope import apply_rope

Stored = torch.Tensor | QuantizedKV


def place_keys(out: torch.Tensor, stored: Stored, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """out [L, H, T, D] (a cache slice, any float dtype) <- RoPE(dequantise(stored)).

    cos, sin: [T, D] rotate-half tables (both halves equal, as :class:`engine.rope.Rotary`
    builds them), attention scaling folded in.
    """
    _check(out, stored)
    layers, heads, tokens, dim = out.shape
    check_shape("cos", cos, (tokens, dim))
    check_shape("sin", sin, (tokens, dim))
    if not isinstance(stored, QuantizedKV):
        rotated = apply_rope(stored.to(device=out.device, dtype=out.dtype).reshape(-1, tokens, dim), cos, sin)
        out.copy_(rotated.view(layers, heads, tokens, dim))
        return
    half = dim // 2
    require(torch.equal(cos[:, :half], cos[:, half:]) and torch.equal(sin[:, :half], sin[:, half:]),
            "cos/sin must repeat over the two halves (rotate-half RoPE)")
    cos, sin = cos[:, :half].float(), sin[:, :half].float()
    stored = stored.to(out.device)
    for tokens_of, rows in stored.group_slices():
        first, second = _dequantized_halves(stored, tokens_of, rows, half)
        target = out[:, :, tokens_of]
        cos_t, sin_t = cos[tokens_of], sin[tokens_of]
        torch.mul(first, cos_t, out=target[..., :half])
        target[..., :half].addcmul_(second, sin_t, value=-1)
        torch.mul(second, cos_t, out=target[..., half:])
        target[..., half:].addcmul_(first, sin_t)


def place_values(out: torch.Tensor, stored: Stored) -> None:
    """out [L, H, T, D] (a cache slice, any float dtype) <- dequantise(stored)."""
    _check(out, stored)
    if not isinstance(stored, QuantizedKV):
        out.copy_(stored)  # converts dtype in place, no temporary
        return
    half = out.shape[3] // 2
    stored = stored.to(out.device)
    for tokens_of, rows in stored.group_slices():
        first, second = _dequantized_halves(stored, tokens_of, rows, half)
        out[:, :, tokens_of, :half] = first
        out[:, :, tokens_of, half:] = second


def _dequantized_halves(stored: QuantizedKV, tokens_of: slice, rows: slice, half: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Float32 dimensions [0, D/2) and [D/2, D) of one token group, dequantised in place."""
    first, second = code_halves(stored.codes[:, :, tokens_of], stored.bits)
    scale, minimum = stored.scale[:, :, rows], stored.minimum[:, :, rows]
    if stored.grouping == "tokens":
        scales = (scale[..., :half], scale[..., half:])
        minima = (minimum[..., :half], minimum[..., half:])
    else:
        scales, minima = _channel_groups(scale, half, stored.group), _channel_groups(minimum, half, stored.group)
    return (_affine(first, scales[0], minima[0], stored.group, stored.grouping),
            _affine(second, scales[1], minima[1], stored.group, stored.grouping))


def _channel_groups(per_group: torch.Tensor, half: int, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The per-token group parameters of each half: one group spanning both, or each its own."""
    if group > half:
        return per_group, per_group
    split = half // group
    return per_group[..., :split], per_group[..., split:]


def _affine(codes: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor, group: int, grouping: str) -> torch.Tensor:
    if grouping == "tokens" or scale.shape[-1] == 1:
        return codes.mul_(scale).add_(minimum)
    grouped = codes.unflatten(-1, (scale.shape[-1], group))
    return grouped.mul_(scale.unsqueeze(-1)).add_(minimum.unsqueeze(-1)).flatten(-2)


def _check(out: torch.Tensor, stored: Stored) -> None:
    check_dtype("out", out, FLOAT_DTYPES)
    require(out.dim() == 4 and out.shape[3] % 2 == 0, f"out must be [L, H, T, D] with D even, got {tuple(out.shape)}")
    require(tuple(stored.shape) == tuple(out.shape), f"stored K/V {tuple(stored.shape)} does not match its cache rows {tuple(out.shape)}")
    if isinstance(stored, QuantizedKV):
        require(stored.grouping == "tokens" or stored.group > out.shape[3] // 2 or (out.shape[3] // 2) % stored.group == 0,
                "a channel group must span both halves of head_dim or tile one half")
    else:
        check_dtype("stored", stored, FLOAT_DTYPES)
