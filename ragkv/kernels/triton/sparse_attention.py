"""Triton kernels for decode attention over chosen or leading cache rows (see
:func:`kernels.sparse_attention.sparse_decode_attention` and
:func:`kernels.decode_attention.decode_attention`).

Split-K ("flash decoding"): one query token gives only Hkv independent heads, far fewer
than a GPU has multiprocessors, so each head's rows are cut into splits, one program
each, and a second kernel merges the splits' partial softmaxes by their log-sum-exps.
With one program per head most of the GPU idles and a step's time grows with the rows read
(BENCHMARKS.md, `ragkv bench kernels`).
"""

import functools

import torch
import triton
import triton.language as tl


@triton.jit
def decode_split_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    idx_ptr,
    len_ptr,
    part_out_ptr,
    part_lse_ptr,
    scale,
    K,
    D,
    GROUP,
    ROWS_PER_SPLIT,
    s_qh,
    s_qd,
    s_kh,
    s_kt,
    s_kd,
    s_vh,
    s_vt,
    s_vd,
    s_ih,
    s_ik,
    HAS_INDICES: tl.constexpr,
    HAS_LENGTHS: tl.constexpr,
    USE_DOT: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Program (KV head, split): its GROUP query heads over rows [split * ROWS_PER_SPLIT, +ROWS_PER_SPLIT)
    of the head's list (``indices[h]``, or rows 0.. when HAS_INDICES is false), cut at K or lengths[h].

    Writes the split's normalised output and log-sum-exp (-inf, output 0, for a split past the
    head's length). With USE_DOT (16-bit caches) both products run on the tensor cores, the
    query group padded to GROUP_PAD >= 16 rows and the probabilities rounded to the cache's
    dtype for the second product, as FlashInfer does; otherwise (float32) they are
    broadcast-multiply-reduce in float32, exact but slower (H100, bfloat16 through this path:
    1.4x for 6% of 32K rows, 2.6x for all of them).
    """
    kv_head = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    offs_g = tl.arange(0, GROUP_PAD)
    offs_d = tl.arange(0, BLOCK_D)
    g_ok = offs_g < GROUP
    d_ok = offs_d < D
    q_heads = kv_head * GROUP + offs_g
    q = tl.load(q_ptr + q_heads[:, None] * s_qh + offs_d[None, :] * s_qd, mask=g_ok[:, None] & d_ok[None, :], other=0.0)
    if not USE_DOT:
        q = q.to(tl.float32)

    n_used = K
    if HAS_LENGTHS:
        n_used = tl.load(len_ptr + kv_head)
    begin = split * ROWS_PER_SPLIT
    end = tl.minimum(begin + ROWS_PER_SPLIT, n_used)

    m_i = tl.full([GROUP_PAD], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([GROUP_PAD], dtype=tl.float32)
    acc = tl.zeros([GROUP_PAD, BLOCK_D], dtype=tl.float32)
    # Every visited block holds at least one used row, so the running max is finite after
    # the first block and exp() never sees -inf - -inf.
    for start in range(begin, end, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        n_ok = offs_n < end
        if HAS_INDICES:
            rows = tl.load(idx_ptr + kv_head * s_ih + offs_n * s_ik, mask=n_ok, other=0).to(tl.int64)
        else:
            rows = offs_n.to(tl.int64)
        tile_mask = n_ok[:, None] & d_ok[None, :]
        k = tl.load(k_ptr + kv_head * s_kh + rows[:, None] * s_kt + offs_d[None, :] * s_kd, mask=tile_mask, other=0.0)
        if USE_DOT:
            logits = tl.dot(q, tl.trans(k)) * scale
        else:
            logits = tl.sum(q[:, None, :] * k.to(tl.float32)[None, :, :], axis=2) * scale
        logits = tl.where(n_ok[None, :], logits, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(logits, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(logits - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_ptr + kv_head * s_vh + rows[:, None] * s_vt + offs_d[None, :] * s_vd, mask=tile_mask, other=0.0)
        if USE_DOT:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        else:
            acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v.to(tl.float32)[None, :, :], axis=1)
        m_i = m_new

    part = kv_head * tl.num_programs(1) + split
    has_rows = l_i > 0
    out = tl.where(has_rows[:, None], acc / tl.where(has_rows, l_i, 1.0)[:, None], 0.0)
    tl.store(part_out_ptr + (part * GROUP_PAD + offs_g[:, None]) * BLOCK_D + offs_d[None, :], out)
    tl.store(part_lse_ptr + part * GROUP_PAD + offs_g, m_i + tl.log(l_i))


@triton.jit
def merge_splits_kernel(
    part_out_ptr,
    part_lse_ptr,
    out_ptr,
    lse_ptr,
    NUM_SPLITS,
    D,
    GROUP,
    s_oh,
    s_od,
    GROUP_PAD: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Program per KV head: softmax-weighted sum of its splits' outputs. Split 0 always holds
    rows (every head reads at least one), so the running max is finite from the start."""
    kv_head = tl.program_id(0).to(tl.int64)
    offs_g = tl.arange(0, GROUP_PAD)
    offs_d = tl.arange(0, BLOCK_D)
    m_i = tl.full([GROUP_PAD], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([GROUP_PAD], dtype=tl.float32)
    acc = tl.zeros([GROUP_PAD, BLOCK_D], dtype=tl.float32)
    for split in range(0, NUM_SPLITS):
        part = kv_head * NUM_SPLITS + split
        lse = tl.load(part_lse_ptr + part * GROUP_PAD + offs_g)
        out = tl.load(part_out_ptr + (part * GROUP_PAD + offs_g[:, None]) * BLOCK_D + offs_d[None, :])
        m_new = tl.maximum(m_i, lse)
        alpha = tl.exp(m_i - m_new)
        weight = tl.exp(lse - m_new)
        l_i = l_i * alpha + weight
        acc = acc * alpha[:, None] + weight[:, None] * out
        m_i = m_new
    q_heads = kv_head * GROUP + offs_g
    g_ok = offs_g < GROUP
    tl.store(
        out_ptr + q_heads[:, None] * s_oh + offs_d[None, :] * s_od,
        (acc / l_i[:, None]).to(out_ptr.dtype.element_ty),
        mask=g_ok[:, None] & (offs_d < D)[None, :],
    )
    tl.store(lse_ptr + q_heads, m_i + tl.log(l_i), mask=g_ok)


_TILE_ELEMS = 4096
"""Upper bound on GROUP_PAD * BLOCK_N * BLOCK_D, the float32 product tile a block
materialises: 4096 compiles without register spills for sm_90 (ptxas -v, num_warps=4) for
groups up to 8 at D=128; 8192 spills."""

_DOT_GROUP_ROWS = 16  # tl.dot's smallest M
_DOT_BLOCK_N = 64
_MIN_ROWS_PER_SPLIT = 32
_PROGRAMS_PER_SM = 4


@functools.cache
def _multiprocessors(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def split_count(heads: int, rows: int, device: torch.device) -> int:
    """Splits per KV head: enough programs for a few per multiprocessor (on the CPU
    interpreter, a few per head, so tests cross split boundaries), none under 32 rows."""
    programs = _PROGRAMS_PER_SM * (_multiprocessors(device.index or 0) if device.type == "cuda" else 1)
    return max(1, min(triton.cdiv(programs, heads), triton.cdiv(rows, _MIN_ROWS_PER_SPLIT)))


def launch_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    indices: torch.Tensor | None,
    rows: int,
    lengths: torch.Tensor | None,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [Hq, D] in q's dtype, lse [Hq] float32) of q [Hq, D] over rows of k/v_cache [Hkv, T, D]:
    each head's indices[h, :lengths[h]] (or its first `rows` rows when indices is None)."""
    hq, d = q.shape
    hkv = k_cache.shape[0]
    group = hq // hkv
    block_d = triton.next_power_of_2(d)
    # Triton's CPU interpreter multiplies bfloat16 dots as raw bits (numpy has no bfloat16), so
    # there bfloat16 takes the float32 path; its dot path is checked on a GPU (ragkv bench kernels).
    dot_dtypes = (torch.float16, torch.bfloat16) if q.is_cuda else (torch.float16,)
    use_dot = q.dtype in dot_dtypes and k_cache.dtype == q.dtype and d >= 16
    if use_dot:
        group_pad, block_n = max(_DOT_GROUP_ROWS, triton.next_power_of_2(group)), _DOT_BLOCK_N
    else:
        group_pad = triton.next_power_of_2(group)
        block_n = max(1, min(64, _TILE_ELEMS // (group_pad * block_d)))
    splits = split_count(hkv, rows, q.device)
    rows_per_split = triton.cdiv(triton.cdiv(rows, splits), block_n) * block_n
    splits = triton.cdiv(rows, rows_per_split)
    part_out = torch.empty((hkv, splits, group_pad, block_d), dtype=torch.float32, device=q.device)
    part_lse = torch.empty((hkv, splits, group_pad), dtype=torch.float32, device=q.device)
    out = torch.empty((hq, d), dtype=q.dtype, device=q.device)
    lse = torch.empty((hq,), dtype=torch.float32, device=q.device)
    index_args = (indices, *indices.stride()) if indices is not None else (part_lse, 0, 0)  # unread without indices
    # int32 lengths keep the kernel's loop bound the same type as its counter.
    lengths32 = lengths.int() if lengths is not None else part_lse  # unread when HAS_LENGTHS=False
    decode_split_kernel[(hkv, splits)](
        q,
        k_cache,
        v_cache,
        index_args[0],
        lengths32,
        part_out,
        part_lse,
        float(scale),
        rows,
        d,
        group,
        rows_per_split,
        *q.stride(),
        *k_cache.stride(),
        *v_cache.stride(),
        *index_args[1:],
        HAS_INDICES=indices is not None,
        HAS_LENGTHS=lengths is not None,
        USE_DOT=use_dot,
        GROUP_PAD=group_pad,
        BLOCK_N=block_n,
        BLOCK_D=block_d,
    )
    merge_splits_kernel[(hkv,)](
        part_out,
        part_lse,
        out,
        lse,
        splits,
        d,
        group,
        *out.stride(),
        GROUP_PAD=group_pad,
        BLOCK_D=block_d,
    )
    return out, lse
