"""Exact causal attention for the three row layouts the forward loop produces.

A prefill from position 0 is triangular (the fused causal kernel), a decode row sees every
cached row (no mask), and anything else (selective recompute, a prefill after a cached
prefix) is a causal-by-position mask over an arbitrary row subset. A sliding-window layer
(Gemma 3) sees only its last `window` positions; where the window cuts anything off, its
rows run a masked attention over the span the window can reach.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ragkv.engine.numerics import attention_compute_dtype
from ragkv.kernels.decode_attention import decode_attention as batched_decode_attention
from ragkv.kernels.selective_attention import reads_cache_in_place, selective_attention, takes_whole_prefills


def causal_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    positions: torch.Tensor,
    scale: float,
    window: int | None = None,
) -> torch.Tensor:
    """q [Hq, N, D] at `positions` [N] (ascending) over cache rows keys/values [Hkv, T, D]
    (row j = position j). With `window`, the row at position p sees rows p - window + 1 .. p."""
    rows, cached = q.shape[1], keys.shape[1]
    first, last = int(positions[0]), int(positions[-1])
    if window is not None and last - window + 1 > 0:
        first, last = int(positions.min()), int(positions.max())  # selective recompute may pass any order
        start = max(0, first - window + 1)
        if rows == 1 and first >= cached - 1:
            return decode_attention(q, keys[:, start:], values[:, start:], scale)
        return windowed_attention(
            q, keys[:, start : last + 1], values[:, start : last + 1], positions - start, scale, window
        )
    if rows == 1 and first >= cached - 1:
        return decode_attention(q, keys, values, scale)
    whole_prefix = rows == cached and first == 0 and last == cached - 1
    # a prefill from row 0 is SDPA's fused causal kernel, unless the bf16 flash loop runs here
    if (not whole_prefix or takes_whole_prefills(q, keys, values)) and reads_cache_in_place(q, keys, values):
        return selective_attention(q, keys, values, positions, scale)
    compute = attention_compute_dtype(keys.dtype, keys.device)
    if compute != keys.dtype:
        # widened per layer: a copy of the rows is cheap next to the attention itself
        return causal_attention(q.to(compute), keys.to(compute), values.to(compute), positions, scale).to(q.dtype)
    if whole_prefix:
        return _sdpa(q, keys, values, scale, is_causal=True)
    return selective_attention(q, keys, values, positions, scale)


def windowed_attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor, scale: float, window: int
) -> torch.Tensor:
    """Causal attention limited to a sliding window, as one masked SDPA: q [Hq, N, D] at
    `positions` [N] over rows keys/values [Hkv, S, D] (row j = position j). No compiled
    kernel takes a lower bound per row; the span is at most the rows plus one window."""
    compute = attention_compute_dtype(keys.dtype, keys.device)
    columns = torch.arange(keys.shape[1], device=keys.device)
    offset = columns[None, :] - positions[:, None].to(keys.device)
    visible = (offset <= 0) & (offset > -window)
    out = F.scaled_dot_product_attention(
        q[None].to(compute),
        keys[None].to(compute),
        values[None].to(compute),
        attn_mask=visible[None, None],
        scale=scale,
        enable_gqa=True,
    )[0]
    return out.to(q.dtype)


def decode_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float) -> torch.Tensor:
    """Rows that see every cached row (decode): no mask. q [Hq, 1, D] over keys/values [Hkv, T, D]."""
    return batched_decode_attention(q.transpose(0, 1), [keys], [values], [keys.shape[1]], scale).transpose(0, 1)


def _sdpa(q, keys, values, scale: float, is_causal: bool) -> torch.Tensor:
    # 4-D inputs: torch's CPU flash path does not take 3-D ones (they fall back to the slow math path).
    return F.scaled_dot_product_attention(
        q[None], keys[None], values[None], is_causal=is_causal, scale=scale, enable_gqa=True
    )[0]
