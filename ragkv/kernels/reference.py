"""Torch reference implementations of every op in :mod:`kernels`.

These define the semantics the Triton and FlashInfer kernels are tested against
and are the CPU fallback. They favour obviousness over speed: inputs are upcast to
float32, computed with plain torch ops, and cast back to the input dtype. Shapes
are for one sequence; GQA maps query head ``h`` to KV head ``h // group``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ragkv.kernels.kv_quant import QuantizedKV, code_halves


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """cat(-x2, x1) over the last dim, the Hugging Face Llama RoPE convention."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [H, T, D]; cos/sin: [T, D] -> x*cos + rotate_half(x)*sin, in x.dtype."""
    xf = x.float()
    return (xf * cos.float() + rotate_half(xf) * sin.float()).to(x.dtype)


def code_scores(centroid_scores: torch.Tensor, codes: torch.Tensor, valid_mask: torch.Tensor | None) -> torch.Tensor:
    """Approximate per-token scores [Hkv, T] float32 from quantisation codes.

    Scalar codes: codes [Hkv, T], centroid_scores [Hkv, C].
    Product quantisation: codes [Hkv, T, M], centroid_scores [Hkv, M, C]; the
    score is the sum over the M sub-spaces. Invalid tokens score -inf.
    """
    table = centroid_scores.float()
    if codes.dim() == 2:
        scores = torch.gather(table, 1, codes.long())
    else:
        # table[h, m, codes[h, t, m]] for every t, summed over m.
        per_sub = torch.gather(table, 2, codes.long().transpose(1, 2))  # [Hkv, M, T]
        scores = per_sub.sum(dim=1)
    if valid_mask is not None:
        scores = scores.masked_fill(~valid_mask, float("-inf"))
    return scores


def code_score_topk(
    centroid_scores: torch.Tensor, codes: torch.Tensor, k: int, valid_mask: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k (values float32, indices int64), each [Hkv, k], sorted descending."""
    return torch.topk(code_scores(centroid_scores, codes, valid_mask), k, dim=-1, sorted=True)


def sparse_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    indices: torch.Tensor,
    scale: float,
    lengths: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One decode step over the gathered rows; returns (out [Hq, D], lse [Hq] float32).

    KV head h reads rows ``indices[h, :lengths[h]]`` (all K when lengths is None);
    the lse is the natural-log log-sum-exp of the scaled logits.
    """
    hq, d = q.shape
    hkv, num_sel = indices.shape
    group = hq // hkv
    rows = indices.long().unsqueeze(-1).expand(hkv, num_sel, d)
    k_sel = torch.gather(k_cache.float(), 1, rows)  # [Hkv, K, D]
    v_sel = torch.gather(v_cache.float(), 1, rows)
    qg = q.float().view(hkv, group, d)
    logits = torch.einsum("hgd,hkd->hgk", qg, k_sel) * scale
    if lengths is not None:
        used = torch.arange(num_sel, device=q.device) < lengths.view(hkv, 1, 1)
        logits = logits.masked_fill(~used, float("-inf"))
    lse = torch.logsumexp(logits, dim=-1)
    probs = torch.exp(logits - lse.unsqueeze(-1))
    out = torch.einsum("hgk,hkd->hgd", probs, v_sel)
    return out.reshape(hq, d).to(q.dtype), lse.reshape(hq)


def selective_attention(
    q_rows: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    row_positions: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """q_rows [Hq, N, D] attend to cache rows j <= row_positions[i]; out [Hq, N, D]."""
    t = k_cache.shape[1]
    mask = torch.arange(t, device=q_rows.device).unsqueeze(0) <= row_positions.unsqueeze(1)  # [N, T]
    out = F.scaled_dot_product_attention(
        q_rows.float()[None], k_cache.float()[None], v_cache.float()[None], attn_mask=mask, scale=scale, enable_gqa=True
    )
    return out[0].to(q_rows.dtype)


def dequantize(quantized: QuantizedKV) -> torch.Tensor:
    """Float32 [L, H, T, D] of quantised K/V: minimum + code * scale, per group."""
    low, high = code_halves(quantized.codes, quantized.bits)
    codes = torch.cat((low, high), dim=-1)
    layers, heads, tokens, dim = quantized.shape
    if quantized.grouping == "tokens":
        index = torch.arange(tokens, device=codes.device) // quantized.group
        scale, minimum = quantized.scale.float()[:, :, index], quantized.minimum.float()[:, :, index]
    elif quantized.scale.shape[1] == 1 and heads > 1:  # one group across the layer's heads
        scale, minimum = quantized.scale.float(), quantized.minimum.float()
    else:
        scale = quantized.scale.float().repeat_interleave(quantized.group, dim=3)
        minimum = quantized.minimum.float().repeat_interleave(quantized.group, dim=3)
    return minimum + codes * scale


def place_keys(
    stored: torch.Tensor | QuantizedKV, cos: torch.Tensor, sin: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """Stored pre-RoPE keys [L, H, T, D] -> dequantised, rotated keys in `dtype`."""
    keys = dequantize(stored) if isinstance(stored, QuantizedKV) else stored.float()
    layers, heads, tokens, dim = keys.shape
    return rope(keys.reshape(-1, tokens, dim), cos, sin).view(layers, heads, tokens, dim).to(dtype)


def place_values(stored: torch.Tensor | QuantizedKV, dtype: torch.dtype) -> torch.Tensor:
    """Stored values [L, H, T, D] -> dequantised values in `dtype`."""
    return (dequantize(stored) if isinstance(stored, QuantizedKV) else stored).to(dtype)


def decode_attention(
    q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor], lengths: list[int], scale: float
) -> torch.Tensor:
    """Dense decode attention of B requests: q [B, Hq, D]; request b attends to the first
    lengths[b] rows of keys[b]/values[b] [Hkv, capacity, D]. Returns [B, Hq, D] in q.dtype."""
    outs = []
    for b, length in enumerate(lengths):
        k, v = keys[b][:, :length].float(), values[b][:, :length].float()
        hkv, dim = k.shape[0], k.shape[2]
        grouped = q[b].float().reshape(hkv, -1, dim)
        weights = torch.softmax(grouped @ k.transpose(1, 2) * scale, dim=-1)
        outs.append((weights @ v).reshape(q.shape[1], dim))
    return torch.stack(outs).to(q.dtype)
