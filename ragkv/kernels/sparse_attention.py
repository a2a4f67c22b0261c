"""Decode attention that reads only selected cache rows (retrieval-based sparse decode).

Each KV head reads its own row list (typically the top-k of
:func:`kernels.code_scores.code_score_topk`); all query heads of its GQA group
share those rows. Dense decode is the special case ``indices = arange(T)``.
"""

from __future__ import annotations

import torch

from ragkv.kernels import torch_cpu
from ragkv.kernels.checks import FLOAT_DTYPES, INDEX_DTYPES, check_dtype, check_shape, common_device, require
from ragkv.kernels.dispatch import Backend, select_backend


def sparse_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    indices: torch.Tensor,
    scale: float,
    lengths: torch.Tensor | None = None,
    *,
    return_lse: bool = False,
    backend: Backend = "auto",
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """softmax(q . K_sel^T * scale) V_sel for one decode step.

    Args:
        q: [Hq, D]; Hq = Hkv * group, query head h reads KV head h // group.
        k_cache, v_cache: [Hkv, T, D], same dtype as q (float32/float16/bfloat16).
        indices: [Hkv, K] int; KV head h reads rows indices[h, :lengths[h]],
            values in [0, T) (precondition, unchecked). Repeated rows count twice.
        scale: softmax scale, usually 1/sqrt(D).
        lengths: optional [Hkv] int, 1 <= lengths[h] <= K (precondition), for
            ragged per-head selections padded to K; None means all K rows.
        return_lse: also return the natural-log log-sum-exp of the scaled logits.
        backend: "auto", "torch", "triton" or "flashinfer" (float16/bfloat16 only).

    Returns out [Hq, D] in q's dtype, or (out, lse [Hq] float32).
    """
    check_dtype("q", q, FLOAT_DTYPES)
    check_dtype("indices", indices, INDEX_DTYPES)
    require(q.dim() == 2, f"q must be [Hq, D], got {tuple(q.shape)}")
    require(k_cache.dim() == 3, f"k_cache must be [Hkv, T, D], got {tuple(k_cache.shape)}")
    hq, d = q.shape
    hkv, t, _ = k_cache.shape
    check_shape("k_cache", k_cache, (hkv, t, d))
    check_shape("v_cache", v_cache, (hkv, t, d))
    require(k_cache.dtype == q.dtype and v_cache.dtype == q.dtype, "q, k_cache and v_cache must share a dtype")
    require(hkv > 0 and hq % hkv == 0, f"Hq ({hq}) must be a multiple of Hkv ({hkv})")
    require(
        indices.dim() == 2 and indices.shape[0] == hkv and indices.shape[1] > 0,
        f"indices must be [Hkv={hkv}, K>0], got {tuple(indices.shape)}",
    )
    if lengths is not None:
        check_dtype("lengths", lengths, INDEX_DTYPES)
        check_shape("lengths", lengths, (hkv,))
    device = common_device(q=q, k_cache=k_cache, v_cache=v_cache, indices=indices, lengths=lengths)

    # FlashInfer's decode kernels take float16/bfloat16 only.
    kernels = ("triton",) if q.dtype == torch.float32 else ("triton", "flashinfer")
    chosen = select_backend("sparse_decode_attention", backend, device, kernels=kernels)
    if chosen == "torch":
        out, lse = torch_cpu.sparse_decode_attention(q, k_cache, v_cache, indices, scale, lengths, need_lse=return_lse)
    elif chosen == "flashinfer":
        from ragkv.kernels.flashinfer.sparse_attention import sparse_decode_flashinfer

        out, lse = sparse_decode_flashinfer(q, k_cache, v_cache, indices, scale, lengths)
    else:
        out, lse = _sparse_decode_triton(q, k_cache, v_cache, indices, scale, lengths)
    return (out, lse) if return_lse else out


def _sparse_decode_triton(q, k_cache, v_cache, indices, scale, lengths):
    from ragkv.kernels.triton.sparse_attention import launch_decode

    return launch_decode(q, k_cache, v_cache, indices, indices.shape[1], lengths, scale)
