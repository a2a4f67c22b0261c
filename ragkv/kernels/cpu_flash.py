"""Selective attention through torch's CPU flash-attention kernel, for bfloat16 caches on
CPUs with AVX512-BF16 (and AMX), where that kernel's matmuls run on bfloat16 hardware.

Rows are sorted by position and taken in blocks. Every row of a block sees the cache rows
before the block's first position, so that part is one unmasked call; the block's own span
[first, last] is a second call with a causal-by-position mask. The two partial results are
merged by their logsumexps (the flash kernel returns them). A KV head's query heads are
stacked as rows of one call, so each key block is read once per KV head, as in GQA.

Where the compiled CPU kernels are built, their `flash_blocks` runs the blocks (one parallel
region per call, `cpu/flash_blocks.h`); elsewhere a loop here does, one flash call at a time.

On AVX512-BF16 without AMX (Zen 4) torch's flash kernel multiplies bf16 no faster than
float32: "auto" runs the compiled `bf16_flash` backend there instead (ragkv.kernels.bf16_flash).
"""

from __future__ import annotations

import torch

from ragkv.kernels import cpu_extension
from ragkv.kernels.row_order import by_position

REQUIRED_FLAGS = frozenset({"avx512_bf16"})
"""CPU flags under which "auto" picks this path: without them oneDNN emulates bfloat16
matmuls, slower than the compiled float32 kernel."""
BLOCK_ROWS = 128
"""Query rows per block: larger blocks read the cache fewer times but compute more masked
entries in their span (rows are spread over the whole prompt)."""


def fast_here() -> bool:
    """Whether this CPU multiplies bfloat16 in hardware (AVX512-BF16, AMX)."""
    return REQUIRED_FLAGS <= cpu_extension.cpu_flags()


def available() -> bool:
    """Whether this torch has the CPU flash kernel that returns logsumexps."""
    return hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu")


def _flash(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float, mask: torch.Tensor | None):
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, keys, values, attn_mask=mask, scale=scale)


def selective_attention(
    q_rows: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, row_positions: torch.Tensor, scale: float
) -> torch.Tensor:
    """q_rows [Hq, N, D] attend to cache rows j <= row_positions[i] of k_cache, v_cache
    [Hkv, T, D] (one dtype, last dim contiguous); any row order. Returns [Hq, N, D]."""
    from ragkv.kernels.dispatch import compiled  # dispatch imports this module

    module = compiled()

    def run(q: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        bounds = positions.tolist()
        if module is not None:
            return module.flash_blocks(q, k_cache, v_cache, bounds, scale, BLOCK_ROWS)
        return _blocks(q, k_cache, v_cache, positions, bounds, scale)

    return by_position(q_rows, row_positions, run)


def _blocks(
    q_rows: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    positions: torch.Tensor,
    bounds: list[int],
    scale: float,
) -> torch.Tensor:
    """The blocks one flash call at a time: rows sorted, `bounds` their positions as a list."""
    hq, n, d = q_rows.shape
    hkv = k_cache.shape[0]
    group = hq // hkv
    keys, values = k_cache[None], v_cache[None]
    out = torch.empty((hq, n, d), dtype=q_rows.dtype)
    for start in range(0, n, BLOCK_ROWS):
        end = min(n, start + BLOCK_ROWS)
        rows, first, last = end - start, bounds[start], bounds[end - 1]
        # [Hkv, group * rows, D]: query head h * group + g of row r is row g * rows + r of KV head h
        q = q_rows[:, start:end].reshape(1, hkv, group * rows, d)
        columns = torch.arange(first, last + 1)
        hidden = columns[None, :] > positions[start:end].repeat(group)[:, None]
        mask = torch.zeros(hidden.shape, dtype=q.dtype).masked_fill_(hidden, float("-inf"))
        span, span_lse = _flash(q, keys[:, :, first : last + 1], values[:, :, first : last + 1], scale, mask)
        if first > 0:
            before, before_lse = _flash(q, keys[:, :, :first], values[:, :, :first], scale, None)
            # the share of each part in the softmax over both is sigmoid(lse difference)
            weight = torch.sigmoid(before_lse - span_lse).unsqueeze(-1)
            span = torch.lerp(span.float(), before.float(), weight)
        out[:, start:end] = span.reshape(hq, rows, d)
    return out
