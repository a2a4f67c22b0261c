"""Triton kernel for rotate-half RoPE (see :func:`kernels.rope.apply_rope`)."""

import triton
import triton.language as tl


@triton.jit
def rope_kernel(
    x_ptr,
    cos_ptr,
    sin_ptr,
    out_ptr,
    T,
    HALF,
    s_xh,
    s_xt,
    s_xd,
    s_ct,
    s_cd,
    s_st,
    s_sd,
    s_oh,
    s_ot,
    s_od,
    BLOCK_T: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    """One program rotates BLOCK_T tokens of one head.

    Works on the two halves separately so cos/sin need not repeat across halves:
    out1 = x1*cos1 - x2*sin1, out2 = x2*cos2 + x1*sin2.
    """
    head = tl.program_id(0).to(tl.int64)
    offs_t = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_d = tl.arange(0, BLOCK_HALF)
    mask = (offs_t < T)[:, None] & (offs_d < HALF)[None, :]
    t_col = offs_t[:, None]
    d_lo = offs_d[None, :]
    d_hi = d_lo + HALF

    x_row = x_ptr + head * s_xh + t_col * s_xt
    x1 = tl.load(x_row + d_lo * s_xd, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_row + d_hi * s_xd, mask=mask, other=0.0).to(tl.float32)
    cos1 = tl.load(cos_ptr + t_col * s_ct + d_lo * s_cd, mask=mask, other=0.0).to(tl.float32)
    cos2 = tl.load(cos_ptr + t_col * s_ct + d_hi * s_cd, mask=mask, other=0.0).to(tl.float32)
    sin1 = tl.load(sin_ptr + t_col * s_st + d_lo * s_sd, mask=mask, other=0.0).to(tl.float32)
    sin2 = tl.load(sin_ptr + t_col * s_st + d_hi * s_sd, mask=mask, other=0.0).to(tl.float32)

    out_row = out_ptr + head * s_oh + t_col * s_ot
    tl.store(out_row + d_lo * s_od, (x1 * cos1 - x2 * sin1).to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(out_row + d_hi * s_od, (x2 * cos2 + x1 * sin2).to(out_ptr.dtype.element_ty), mask=mask)
