"""Exact causal attention for the three row layouts the forward loop produces.

A prefill from position 0 is triangular (the fused causal kernel), a decode row sees every
cached row (no mask), and anything else (selective recompute, a prefill after a cached
prefix) is a causal-by-position mask over an arbitrary row subset.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ragkv.kernels.selective_attention import selective_attention


def causal_attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor, scale: float
) -> torch.Tensor:
    """q [Hq, N, D] at `positions` [N] over cache rows keys/values [Hkv, T, D] (row j = position j)."""
    rows, cached = q.shape[1], keys.shape[1]
    first, last = int(positions[0]), int(positions[-1])
    if rows == cached and first == 0 and last == cached - 1 and rows == last - first + 1:
        return _sdpa(q, keys, values, scale, is_causal=True)
    if rows == 1 and first >= cached - 1:
        return decode_attention(q, keys, values, scale)
    return selective_attention(q, keys, values, positions, scale)


def decode_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float) -> torch.Tensor:
    """Rows that see every cached row (decode): no mask."""
    if q.device.type != "cpu":
        return _sdpa(q, keys, values, scale, is_causal=False)
    return _cpu_decode_attention(q, keys, values, scale)


def _cpu_decode_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float) -> torch.Tensor:
    # torch's CPU SDPA runs a decode row 5-8x slower in bf16 than two matmuls per KV head,
    # and copies a cache slice that is not contiguous across heads; each head's rows are.
    kv_heads, rows, dim = keys.shape
    grouped = q.reshape(kv_heads, -1, dim)
    out = torch.empty_like(grouped)
    for head in range(kv_heads):
        scores = (grouped[head] @ keys[head].t()).float().mul_(scale)
        torch.mm(torch.softmax(scores, dim=-1).to(values.dtype), values[head], out=out[head])
    return out.view(q.shape)


def _sdpa(q, keys, values, scale: float, is_causal: bool) -> torch.Tensor:
    # 4-D inputs: torch's CPU flash path does not take 3-D ones (3-4x slower).
    return F.scaled_dot_product_attention(
        q[None], keys[None], values[None], is_causal=is_causal, scale=scale, enable_gqa=True
    )[0]
