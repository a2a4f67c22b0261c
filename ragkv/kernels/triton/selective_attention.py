"""Triton kernel for selective attention (see :func:`kernels.selective_attention.selective_attention`)."""

import triton
import triton.language as tl


@triton.jit
def selective_attention_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    pos_ptr,
    out_ptr,
    qk_scale,
    N,
    T,
    D,
    GROUP,
    s_qh,
    s_qn,
    s_qd,
    s_kh,
    s_kt,
    s_kd,
    s_vh,
    s_vt,
    s_vd,
    s_p,
    s_oh,
    s_on,
    s_od,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Flash-attention forward for BLOCK_M arbitrary query rows of one query head.

    Row i may see cache rows j <= pos[i]; the rows need not be sorted or
    contiguous, so the key loop runs up to the largest position in the block and
    the mask does the rest. ``qk_scale`` already includes log2(e) so the softmax
    uses exp2. ``DOT_PRECISION`` is "ieee" for float32 inputs (tf32 would lose
    ~3 digits) and the default for 16-bit inputs.
    """
    head = tl.program_id(1).to(tl.int64)
    kv_head = head // GROUP
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    m_ok = offs_m < N
    d_ok = offs_d < D
    # Padding rows get position 0 so they stay finite; they are never stored.
    pos = tl.load(pos_ptr + offs_m * s_p, mask=m_ok, other=0)
    q = tl.load(
        q_ptr + head * s_qh + offs_m[:, None] * s_qn + offs_d[None, :] * s_qd,
        mask=m_ok[:, None] & d_ok[None, :],
        other=0.0,
    )

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    hi = tl.minimum(tl.max(pos, axis=0) + 1, T)
    # Key 0 is visible to every row (pos >= 0), so each row's max is finite after
    # the first block and later fully-masked blocks contribute exp2(-inf) = 0.
    for start in range(0, hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        n_ok = offs_n < T
        k_t = tl.load(
            k_ptr + kv_head * s_kh + offs_n[None, :] * s_kt + offs_d[:, None] * s_kd,
            mask=n_ok[None, :] & d_ok[:, None],
            other=0.0,
        )
        logits = tl.dot(q, k_t, input_precision=DOT_PRECISION) * qk_scale
        visible = (offs_n[None, :] <= pos[:, None]) & n_ok[None, :]
        logits = tl.where(visible, logits, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(logits, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(logits - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(
            v_ptr + kv_head * s_vh + offs_n[:, None] * s_vt + offs_d[None, :] * s_vd,
            mask=n_ok[:, None] & d_ok[None, :],
            other=0.0,
        )
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    out = acc / l_i[:, None]
    tl.store(
        out_ptr + head * s_oh + offs_m[:, None] * s_on + offs_d[None, :] * s_od,
        out.to(out_ptr.dtype.element_ty),
        mask=m_ok[:, None] & d_ok[None, :],
    )
