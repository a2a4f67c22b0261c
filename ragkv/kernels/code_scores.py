"""Approximate attention scores from quantised keys, and the top-k tokens they pick.

Retrieval-based sparse decode scores every cached token cheaply through its
key's code: the caller computes ``centroid_scores`` (query . centroid) once per
step, then each token's score is a table lookup. The top-k tokens per KV head
are the rows :func:`kernels.sparse_attention.sparse_decode_attention` reads.
"""

from __future__ import annotations

import torch

from ragkv.kernels import reference
from ragkv.kernels.checks import FLOAT_DTYPES, check_dtype, check_shape, common_device, require
from ragkv.kernels.dispatch import Backend, select_backend

_BLOCK_T = 256
_CODE_DTYPES = (torch.int16, torch.int32, torch.int64)


def code_score_topk(
    centroid_scores: torch.Tensor,
    codes: torch.Tensor,
    k: int,
    valid_mask: torch.Tensor | None = None,
    *,
    backend: Backend = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k tokens per KV head by code score.

    Args:
        centroid_scores: [Hkv, C] (scalar codes) or [Hkv, M, C] (product
            quantisation), float; accumulated in float32.
        codes: [Hkv, T] or [Hkv, T, M], int16/int32/int64, values in [0, C)
            (a precondition, not checked: that would cost a device sync).
        k: tokens to keep per head, 1 <= k <= number of valid tokens.
        valid_mask: optional [T] bool; False tokens are never selected.
        backend: "auto", "torch" or "triton".

    Returns:
        (values [Hkv, k] float32, indices [Hkv, k] int64), sorted by score
        descending. With PQ, a token's score is sum_m centroid_scores[h, m, codes[h, t, m]].

    The Triton backend computes the (masked) scores in a kernel and then uses
    ``torch.topk`` on them: top-k over a few thousand scores is not worth a
    custom kernel.
    """
    check_dtype("centroid_scores", centroid_scores, FLOAT_DTYPES)
    check_dtype("codes", codes, _CODE_DTYPES)
    require(codes.dim() in (2, 3), f"codes must be [Hkv, T] or [Hkv, T, M], got {tuple(codes.shape)}")
    hkv, t = codes.shape[:2]
    if codes.dim() == 2:
        check_shape("centroid_scores", centroid_scores, (hkv, None))
    else:
        check_shape("centroid_scores", centroid_scores, (hkv, codes.shape[2], None))
    if valid_mask is not None:
        check_dtype("valid_mask", valid_mask, (torch.bool,))
        check_shape("valid_mask", valid_mask, (t,))
    device = common_device(centroid_scores=centroid_scores, codes=codes, valid_mask=valid_mask)
    num_valid = t if valid_mask is None else int(valid_mask.sum())  # host sync: k must be satisfiable
    require(1 <= k <= num_valid, f"k must be in [1, {num_valid}] (valid tokens), got {k}")

    chosen = select_backend("code_score_topk", backend, device, kernels=("triton",))
    if chosen == "torch":
        return reference.code_score_topk(centroid_scores, codes, k, valid_mask)

    import triton

    from ragkv.kernels.triton.code_scores import code_scores_kernel

    # Scalar codes are PQ with one sub-space: view them as [Hkv, T, 1] / [Hkv, 1, C].
    codes3 = codes if codes.dim() == 3 else codes.unsqueeze(-1)
    table3 = centroid_scores if centroid_scores.dim() == 3 else centroid_scores.unsqueeze(1)
    scores = torch.empty((hkv, t), dtype=torch.float32, device=device)
    valid_bytes = valid_mask.view(torch.uint8) if valid_mask is not None else scores  # unread when HAS_MASK=False
    grid = (hkv, triton.cdiv(t, _BLOCK_T))
    code_scores_kernel[grid](
        table3,
        codes3,
        valid_bytes,
        scores,
        t,
        codes3.shape[2],
        *table3.stride(),
        *codes3.stride(),
        *scores.stride(),
        HAS_MASK=valid_mask is not None,
        BLOCK_T=_BLOCK_T,
    )
    return torch.topk(scores, k, dim=-1, sorted=True)
