"""Sparse decode through FlashInfer's paged decode with one token per page.

FlashInfer's page table is shared by all KV heads of a request, while our
selected rows differ per KV head. So each KV head becomes its own "request"
with one KV head and ``group`` query heads, and its selected cache rows become
its pages: with page_size=1, page p of the flattened cache [Hkv*T, 1, 1, D] is
token p % T of KV head p // T.
"""

from __future__ import annotations

import math

import torch

_WORKSPACE_BYTES = 128 * 1024 * 1024
_wrappers: dict[torch.device, object] = {}


def paged_layout(
    k_cache: torch.Tensor, v_cache: torch.Tensor, indices: torch.Tensor, lengths: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Express the selection as a page_size=1 NHD paged cache with batch = Hkv.

    Returns (k_pages [Hkv*T, 1, 1, D], v_pages, kv_indptr [Hkv+1] int32,
    kv_indices [sum(lengths)] int32, kv_last_page_len [Hkv] int32).
    """
    hkv, t, d = k_cache.shape
    num_sel = indices.shape[1]
    counts = torch.full((hkv,), num_sel, dtype=torch.int32, device=indices.device) if lengths is None else lengths.int()
    kv_indptr = torch.zeros(hkv + 1, dtype=torch.int32, device=indices.device)
    kv_indptr[1:] = torch.cumsum(counts, 0)
    pages = indices + torch.arange(hkv, device=indices.device).unsqueeze(1) * t
    used = torch.arange(num_sel, device=indices.device).unsqueeze(0) < counts.unsqueeze(1)
    kv_indices = pages[used].int()  # row-major, so each head's pages stay contiguous and in order
    last_page_len = torch.ones(hkv, dtype=torch.int32, device=indices.device)
    return (
        k_cache.reshape(hkv * t, 1, 1, d),
        v_cache.reshape(hkv * t, 1, 1, d),
        kv_indptr,
        kv_indices,
        last_page_len,
    )


def _wrapper(device: torch.device):
    """One decode wrapper (and its 128 MiB workspace) per device, reused across calls."""
    import flashinfer

    if device not in _wrappers:
        workspace = torch.zeros(_WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        _wrappers[device] = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD")
    return _wrappers[device]


def sparse_decode_flashinfer(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    indices: torch.Tensor,
    scale: float,
    lengths: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [Hq, D], natural-log lse [Hq] float32) via BatchDecodeWithPagedKVCacheWrapper."""
    hq, d = q.shape
    hkv = k_cache.shape[0]
    group = hq // hkv
    k_pages, v_pages, kv_indptr, kv_indices, last_page_len = paged_layout(k_cache, v_cache, indices, lengths)
    wrapper = _wrapper(q.device)
    wrapper.plan(
        kv_indptr, kv_indices, last_page_len,
        group, 1, d, 1,
        pos_encoding_mode="NONE", q_data_type=q.dtype, kv_data_type=k_cache.dtype, sm_scale=scale,
    )
    out, lse = wrapper.run(q.reshape(hkv, group, d), (k_pages, v_pages), return_lse=True)
    # FlashInfer's decode kernels report the log-sum-exp in base 2.
    return out.reshape(hq, d), (lse.float() * math.log(2.0)).reshape(hq)
