"""Triton kernel for the code-score gather (see :func:`kernels.code_scores.code_score_topk`)."""

import triton
import triton.language as tl


@triton.jit
def code_scores_kernel(
    table_ptr,
    codes_ptr,
    valid_ptr,
    out_ptr,
    T,
    M,
    s_bh,
    s_bm,
    s_bc,
    s_ch,
    s_ct,
    s_cm,
    s_oh,
    s_ot,
    HAS_MASK: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    """One program scores BLOCK_T tokens of one KV head.

    score[h, t] = sum_m table[h, m, codes[h, t, m]] (M == 1 for scalar codes),
    accumulated in float32; tokens whose valid flag is 0 get -inf so that a
    following top-k never selects them.
    """
    head = tl.program_id(0).to(tl.int64)
    offs_t = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
    in_range = offs_t < T
    code_row = codes_ptr + head * s_ch + offs_t * s_ct
    acc = tl.zeros([BLOCK_T], dtype=tl.float32)
    for m in range(M):
        code = tl.load(code_row + m * s_cm, mask=in_range, other=0).to(tl.int64)
        acc += tl.load(table_ptr + head * s_bh + m * s_bm + code * s_bc, mask=in_range, other=0.0).to(tl.float32)
    if HAS_MASK:
        valid = tl.load(valid_ptr + offs_t, mask=in_range, other=0)
        acc = tl.where(valid != 0, acc, float("-inf"))
    tl.store(out_ptr + head * s_oh + offs_t * s_ot, acc, mask=in_range)
