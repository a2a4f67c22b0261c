"""Triton kernel for sparse decode attention (see :func:`kernels.sparse_attention.sparse_decode_attention`)."""

import triton
import triton.language as tl


@triton.jit
def sparse_decode_kernel(
    q_ptr, k_ptr, v_ptr, idx_ptr, len_ptr, out_ptr, lse_ptr,
    scale, K, D, GROUP,
    s_qh, s_qd,
    s_kh, s_kt, s_kd,
    s_vh, s_vt, s_vd,
    s_ih, s_ik,
    s_oh, s_od,
    HAS_LENGTHS: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """One program per KV head: its GROUP query heads share each gathered K/V tile.

    Rows are gathered through ``indices`` BLOCK_N at a time and folded into an
    online softmax. Dot products are broadcast-multiply-reduce in float32 rather
    than ``tl.dot``: a decode step is bound by the gather's memory traffic, and
    this keeps full float32 accuracy for every input dtype (no tf32, no M >= 16
    padding of the query group).
    """
    kv_head = tl.program_id(0).to(tl.int64)
    offs_g = tl.arange(0, GROUP_PAD)
    offs_d = tl.arange(0, BLOCK_D)
    g_ok = offs_g < GROUP
    d_ok = offs_d < D
    q_heads = kv_head * GROUP + offs_g
    q = tl.load(
        q_ptr + q_heads[:, None] * s_qh + offs_d[None, :] * s_qd, mask=g_ok[:, None] & d_ok[None, :], other=0.0
    ).to(tl.float32)

    n_used = K
    if HAS_LENGTHS:
        n_used = tl.load(len_ptr + kv_head)

    m_i = tl.full([GROUP_PAD], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([GROUP_PAD], dtype=tl.float32)
    acc = tl.zeros([GROUP_PAD, BLOCK_D], dtype=tl.float32)
    # Every visited block holds at least one used row (the loop stops at n_used >= 1),
    # so the running max is finite after the first block and exp() never sees -inf - -inf.
    for start in range(0, n_used, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        n_ok = offs_n < n_used
        rows = tl.load(idx_ptr + kv_head * s_ih + offs_n * s_ik, mask=n_ok, other=0).to(tl.int64)
        tile_mask = n_ok[:, None] & d_ok[None, :]
        k = tl.load(
            k_ptr + kv_head * s_kh + rows[:, None] * s_kt + offs_d[None, :] * s_kd, mask=tile_mask, other=0.0
        ).to(tl.float32)
        logits = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * scale
        logits = tl.where(n_ok[None, :], logits, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(logits, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(logits - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(
            v_ptr + kv_head * s_vh + rows[:, None] * s_vt + offs_d[None, :] * s_vd, mask=tile_mask, other=0.0
        ).to(tl.float32)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
        m_i = m_new

    out = acc / l_i[:, None]
    tl.store(
        out_ptr + q_heads[:, None] * s_oh + offs_d[None, :] * s_od,
        out.to(out_ptr.dtype.element_ty),
        mask=g_ok[:, None] & d_ok[None, :],
    )
    tl.store(lse_ptr + q_heads, m_i + tl.log(l_i), mask=g_ok)
