"""Write a chunk's stored K/V into its rows of the runtime cache, dequantising on the way.

Keys are stored before RoPE; placing them rotates them to their global positions. For
quantised chunks the dequantisation is fused into that step: each token group's codes
are cast straight into its cache rows (4-bit: the low nibbles into the first half of
head_dim, the high nibbles into the second, the rotate-half pair), scaled in place and
rotated in place, so no float copy of the chunk is made first. Float chunks take the
plain RoPE kernel (:func:`kernels.apply_rope`).
"""

from __future__ import annotations

import torch

from ragkv.kernels.checks import FLOAT_DTYPES, check_dtype, check_shape, require
from ragkv.kernels.kv_quant import QuantizedKV
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
    require(
        torch.equal(cos[:, :half], cos[:, half:]) and torch.equal(sin[:, :half], sin[:, half:]),
        "cos/sin must repeat over the two halves (rotate-half RoPE)",
    )
    cos, sin = cos[:, :half].float(), sin[:, :half].float()
    stored = stored.to(out.device)
    for tokens_of, rows in stored.group_slices():
        target = out[:, :, tokens_of]
        work = _float32_rows(target)
        _dequantize_into(work, stored, tokens_of, rows)
        first, second = work[..., :half], work[..., half:]
        cos_t, sin_t = cos[tokens_of], sin[tokens_of]
        saved = first.clone()  # rotation reads both halves before writing either
        first.mul_(cos_t).addcmul_(second, sin_t, value=-1)
        second.mul_(cos_t).addcmul_(saved, sin_t)
        if work is not target:
            target.copy_(work)


def place_values(out: torch.Tensor, stored: Stored) -> None:
    """out [L, H, T, D] (a cache slice, any float dtype) <- dequantise(stored)."""
    _check(out, stored)
    if not isinstance(stored, QuantizedKV):
        out.copy_(stored)  # converts dtype in place, no temporary
        return
    stored = stored.to(out.device)
    for tokens_of, rows in stored.group_slices():
        target = out[:, :, tokens_of]
        work = _float32_rows(target)
        _dequantize_into(work, stored, tokens_of, rows)
        if work is not target:
            target.copy_(work)


def layers_of(stored: Stored, layers: slice) -> Stored:
    """The stored K/V of a run of layers (a view, codes and scales alike): chunks of a model
    with a RoPE base per layer type are placed one run of layers at a time."""
    if not isinstance(stored, QuantizedKV):
        return stored[layers]
    return QuantizedKV(
        stored.codes[layers], stored.scale[layers], stored.minimum[layers], stored.bits, stored.grouping, stored.group
    )


def _float32_rows(target: torch.Tensor) -> torch.Tensor:
    """Where a group is computed: the cache rows themselves when they are float32, else a
    float32 buffer (a float16/bfloat16 cache would round every intermediate step)."""
    return target if target.dtype == torch.float32 else torch.empty(target.shape, device=target.device)


def _dequantize_into(target: torch.Tensor, stored: QuantizedKV, tokens_of: slice, rows: slice) -> None:
    """Dequantise one token group straight into its cache rows: the codes are cast on the
    copy and scaled in place, so no full-size float temporary is made (on CPUs the page
    faults of fresh temporaries cost more than the arithmetic)."""
    half = target.shape[3] // 2
    codes = stored.codes[:, :, tokens_of]
    if stored.bits == 4:
        target[..., :half].copy_(codes & 0x0F)
        target[..., half:].copy_(codes >> 4)
    else:
        target.copy_(codes)
    scale, minimum = stored.scale[:, :, rows].float(), stored.minimum[:, :, rows].float()
    if stored.grouping == "tokens" or scale.shape[-1] == 1:  # per channel, or one group per head/layer
        target.mul_(scale).add_(minimum)
    else:
        grouped = target.unflatten(-1, (scale.shape[-1], stored.group))
        grouped.mul_(scale.unsqueeze(-1)).add_(minimum.unsqueeze(-1))


def _check(out: torch.Tensor, stored: Stored) -> None:
    check_dtype("out", out, FLOAT_DTYPES)
    require(out.dim() == 4 and out.shape[3] % 2 == 0, f"out must be [L, H, T, D] with D even, got {tuple(out.shape)}")
    require(
        tuple(stored.shape) == tuple(out.shape),
        f"stored K/V {tuple(stored.shape)} does not match its cache rows {tuple(out.shape)}",
    )
    if not isinstance(stored, QuantizedKV):
        check_dtype("stored", stored, FLOAT_DTYPES)
