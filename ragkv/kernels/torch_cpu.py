"""Torch implementations tuned for CPUs, used when no GPU kernel applies.

They compute exactly what the references in kernels/reference.py compute (the tests
compare them), but avoid work the references do for clarity.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

_ROW_GROUPS = 8
_MIN_ROWS_TO_GROUP = 128


def selective_attention(
    q_rows: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, row_positions: torch.Tensor, scale: float
) -> torch.Tensor:
    """Causal-by-position attention, with rows grouped by position so each group reads only
    the cache prefix it can see (a masked square would spend half its work on masked
    entries). 4-D SDPA inputs: torch's CPU fast path does not take 3-D ones."""
    n = q_rows.shape[1]
    if bool((row_positions[1:] < row_positions[:-1]).any()):
        order = torch.argsort(row_positions)
        out = torch.empty_like(q_rows)
        out[:, order] = selective_attention(q_rows[:, order], k_cache, v_cache, row_positions[order], scale)
        return out
    groups = _ROW_GROUPS if n >= _MIN_ROWS_TO_GROUP else 1
    bounds = [round(i * n / groups) for i in range(groups + 1)]
    parts = []
    for start, end in zip(bounds, bounds[1:]):
        if start == end:
            continue
        visible = int(row_positions[end - 1]) + 1
        mask = torch.arange(visible, device=q_rows.device)[None, :] <= row_positions[start:end, None]
        parts.append(
            F.scaled_dot_product_attention(
                q_rows[None, :, start:end],
                k_cache[None, :, :visible],
                v_cache[None, :, :visible],
                attn_mask=mask,
                scale=scale,
                enable_gqa=True,
            )[0]
        )
    return torch.cat(parts, dim=1)


def gather_rows(cache: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """cache[h, indices[h]] for every head: [Hkv, K, D].

    A layer of the KV cache is a view [Hkv, T, D] into a buffer with spare capacity, so
    heads sit a fixed number of rows apart: one flat row lookup (index_select) reads them
    all, several times faster than torch.gather with an expanded index."""
    hkv, t, d = cache.shape
    rows_per_head, remainder = divmod(cache.stride(0), d)
    if cache.stride(2) != 1 or cache.stride(1) != d or remainder or rows_per_head < t:
        return torch.gather(cache, 1, indices.long().unsqueeze(-1).expand(hkv, indices.shape[1], d))
    flat = torch.as_strided(cache, ((hkv - 1) * rows_per_head + t, d), (d, 1))
    offsets = torch.arange(0, hkv * rows_per_head, rows_per_head, device=indices.device).unsqueeze(1)
    return flat.index_select(0, (indices + offsets).view(-1)).view(hkv, indices.shape[1], d)


def sparse_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    indices: torch.Tensor,
    scale: float,
    lengths: torch.Tensor | None,
    need_lse: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The reference's result (out [Hq, D], lse [Hq] float32, or None without need_lse) from
    flat row lookups, in float32 (16-bit CPU matmuls are slower than the upcast). Without
    lse and ragged lengths it is one fused SDPA call over the gathered rows."""
    hq, d = q.shape
    hkv, num_sel = indices.shape
    group = hq // hkv
    keys = gather_rows(k_cache, indices).float()
    values = gather_rows(v_cache, indices).float()
    if not need_lse and lengths is None:
        out = F.scaled_dot_product_attention(
            q.view(1, hq, 1, d).float(), keys[None], values[None], scale=scale, enable_gqa=True
        )
        return out.view(hq, d).to(q.dtype), None
    logits = torch.bmm(q.view(hkv, group, d).float(), keys.transpose(1, 2)).mul_(scale)
    if lengths is not None:
        unused = torch.arange(num_sel, device=q.device) >= lengths.view(hkv, 1, 1)
        logits.masked_fill_(unused, float("-inf"))
    lse = torch.logsumexp(logits, dim=-1, keepdim=True)
    out = torch.bmm(logits.sub_(lse).exp_(), values)
    return out.view(hq, d).to(q.dtype), lse.view(hq)


def decode_attention(
    q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor], lengths: list[int], scale: float
) -> torch.Tensor:
    """The reference's decode attention as two matmuls per request and KV head: torch's CPU
    SDPA runs one bf16 query row several times slower, and copies a cache slice that is not
    contiguous across heads (each head's rows are)."""
    dim = q.shape[2]
    out = torch.empty_like(q)
    for b, length in enumerate(lengths):
        kv_heads = keys[b].shape[0]
        grouped = q[b].reshape(kv_heads, -1, dim).to(keys[b].dtype)
        out_b = out[b].view(kv_heads, -1, dim)
        for head in range(kv_heads):
            k, v = keys[b][head, :length], values[b][head, :length]
            weights = torch.softmax((grouped[head] @ k.t()).float().mul_(scale), dim=-1)
            out_b[head] = weights.to(v.dtype) @ v
    return out
