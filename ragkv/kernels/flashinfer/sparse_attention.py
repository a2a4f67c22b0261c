"""Sparse decode through FlashInfer's paged decode with one token per page.

FlashInfer's page table is shared by all KV heads of a request, while our
selected rows differ per KV head. So each KV head becomes its own "request"
with one KV head and ``group`` query heads, and its selected cache rows become
its pages (page_size=1, NHD).

No copies of the cache: a layer of the KV cache is a view [Hkv, T, D] into a
buffer with spare capacity, so head h's row r sits at a fixed element offset
(h * rows_per_head + r) * D from the view's start. The pages are that same
memory viewed as [pages, 1, 1, D]; page (h * rows_per_head + r) is row r of head
h. Only tensors laid out otherwise (not row-major within a head) are copied.

Plan once per step: FlashInfer's plan() (host-side scheduling, a device sync)
depends on the page counts per request, the head geometry, the dtypes and the
scale, not on which pages are read. Every layer of a decode step has the same
counts (the budget depends only on the number of cached rows), so the wrapper
is built in CUDA-graph mode over fixed index buffers, planned when that
signature changes, and each layer only writes its page indices into the fixed
buffer before run(). Ragged per-head lengths (given as a device tensor) would
need a sync to compare, so those calls plan every time.

Run on an H100 (flashinfer 0.6.0; `ragkv bench kernels`, BENCHMARKS.md): it matches the
torch reference, and a decode step plans once, when its context changes. The CPU tests
drive it against a stand-in for flashinfer that follows the same buffer contract.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

_WORKSPACE_BYTES = 128 * 1024 * 1024


def paged_view(cache: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(pages [P, 1, 1, D] over `cache`'s own memory when its layout allows, else over a
    contiguous copy; rows_per_head: the page distance between heads).
    Row r of head h is page h * rows_per_head + r."""
    hkv, t, d = cache.shape
    rows_per_head, remainder = divmod(cache.stride(0), d)
    if cache.stride(2) != 1 or cache.stride(1) != d or remainder or rows_per_head < t:
        cache, rows_per_head = cache.contiguous(), t
    pages = (hkv - 1) * rows_per_head + t
    return torch.as_strided(cache, (pages, 1, 1, d), (d, d, d, 1)), rows_per_head


def page_indices(indices: torch.Tensor, rows_per_head: int, lengths: torch.Tensor | None) -> torch.Tensor:
    """Pages [sum of lengths] int32, head-major: head h's rows indices[h, :lengths[h]]."""
    hkv, num_sel = indices.shape
    offsets = torch.arange(0, hkv * rows_per_head, rows_per_head, device=indices.device).unsqueeze(1)
    pages = indices.long() + offsets
    if lengths is None:
        return pages.flatten().int()
    used = torch.arange(num_sel, device=indices.device).unsqueeze(0) < lengths.unsqueeze(1)
    return pages[used].int()  # row-major, so each head's pages stay contiguous and in order


def page_counts(hkv: int, num_sel: int, lengths: torch.Tensor | None, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(kv_indptr [Hkv+1] int32, kv_last_page_len [Hkv] int32 = 1) for page_size 1."""
    counts = torch.full((hkv,), num_sel, dtype=torch.int32, device=device) if lengths is None else lengths.int()
    indptr = torch.zeros(hkv + 1, dtype=torch.int32, device=device)
    indptr[1:] = torch.cumsum(counts, 0)
    return indptr, torch.ones(hkv, dtype=torch.int32, device=device)


@dataclass(frozen=True)
class PlanSignature:
    """Everything plan() depends on; None for `rows` when per-head lengths vary (unknown on the host)."""

    heads: int
    rows: int | None
    group: int
    head_dim: int
    q_dtype: torch.dtype
    kv_dtype: torch.dtype
    scale: float


class PlannedDecode:
    """One CUDA-graph-mode decode wrapper over fixed page-table buffers for `heads` requests."""

    def __init__(self, device: torch.device, heads: int, max_pages: int):
        import flashinfer

        self.max_pages = max_pages
        self.indptr = torch.zeros(heads + 1, dtype=torch.int32, device=device)
        self.indices = torch.zeros(max_pages, dtype=torch.int32, device=device)
        self.last_page_len = torch.ones(heads, dtype=torch.int32, device=device)
        workspace = torch.zeros(_WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self.wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            workspace,
            "NHD",
            use_cuda_graph=True,
            paged_kv_indptr_buffer=self.indptr,
            paged_kv_indices_buffer=self.indices,
            paged_kv_last_page_len_buffer=self.last_page_len,
        )
        self.signature: PlanSignature | None = None
        self.plans = 0

    def run(
        self,
        q: torch.Tensor,
        pages: tuple[torch.Tensor, torch.Tensor],
        kv_indices: torch.Tensor,
        lengths: torch.Tensor | None,
        num_sel: int,
        signature: PlanSignature,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if signature.rows is None or signature != self.signature:
            indptr, last_page_len = page_counts(signature.heads, num_sel, lengths, q.device)
            self.wrapper.plan(
                indptr,
                kv_indices,
                last_page_len,
                signature.group,
                1,
                signature.head_dim,
                1,
                pos_encoding_mode="NONE",
                q_data_type=signature.q_dtype,
                kv_data_type=signature.kv_dtype,
                sm_scale=signature.scale,
            )
            self.signature = signature
            self.plans += 1
        else:  # same page counts: only which pages are read changed
            self.indices[: kv_indices.numel()].copy_(kv_indices)
        return self.wrapper.run(q, pages, return_lse=True)


_planned: dict[tuple[torch.device, int], PlannedDecode] = {}


def plans_made() -> int:
    """FlashInfer plan() calls made so far in this process (a decode step should add one at most)."""
    return sum(decode.plans for decode in _planned.values())


def planned_decode(device: torch.device, heads: int, pages_needed: int) -> PlannedDecode:
    """The wrapper for (device, heads), rebuilt with twice the room when a step needs more pages."""
    key = (device, heads)
    current = _planned.get(key)
    if current is None or current.max_pages < pages_needed:
        room = max(pages_needed, 2 * current.max_pages if current is not None else pages_needed)
        _planned[key] = current = PlannedDecode(device, heads, room)
    return current


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
    hkv, num_sel = indices.shape
    group = hq // hkv
    k_pages, rows_per_head = paged_view(k_cache)
    v_pages, v_rows_per_head = paged_view(v_cache)
    if v_rows_per_head != rows_per_head:  # one page table serves both: lay both out alike
        (k_pages, rows_per_head), (v_pages, _) = paged_view(k_cache.contiguous()), paged_view(v_cache.contiguous())
    kv_indices = page_indices(indices, rows_per_head, lengths)
    signature = PlanSignature(hkv, num_sel if lengths is None else None, group, d, q.dtype, k_cache.dtype, float(scale))
    decode = planned_decode(q.device, hkv, hkv * num_sel)
    out, lse = decode.run(q.reshape(hkv, group, d), (k_pages, v_pages), kv_indices, lengths, num_sel, signature)
    # FlashInfer's decode kernels report the log-sum-exp in base 2.
    return out.reshape(hq, d), (lse.float() * math.log(2.0)).reshape(hq)
