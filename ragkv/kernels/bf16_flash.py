"""Selective attention in the compiled `bf16_flash` loop (`cpu/bf16_flash.h`): causal-by-position
flash attention written with AVX512-BF16 `vdpbf16ps` dot products, for bfloat16 caches whose
head dim is a multiple of 64.

It exists for CPUs with AVX512-BF16 and no AMX (Zen 4), where torch's CPU flash kernel
multiplies bfloat16 no faster than float32. It also takes whole causal prefills from row 0
there (`ragkv.engine.attention`). On AMX CPUs "auto" keeps torch's flash kernel (`cpu_flash`),
whose matmuls run on the tile units (BENCHMARKS.md); forced, this loop runs wherever it was
built. It is built only where the compiler targets AVX512-BF16.
"""

from __future__ import annotations

import torch

from ragkv.kernels import cpu_extension
from ragkv.kernels.row_order import by_position

HEAD_DIM_MULTIPLE = 64
"""The loop's register tiles hold 64 dims (one or more zmm pairs of bf16 values)."""
PREFERRED_AWAY_FROM = frozenset({"amx_bf16"})
"""CPU flags under which "auto" prefers torch's flash kernel, which uses them."""


def built(module) -> bool:
    """Whether the compiled kernels' module holds the loop (built for AVX512-BF16)."""
    return module is not None and hasattr(module, "bf16_flash")


def preferred_here() -> bool:
    """Whether "auto" should pick this loop over torch's flash kernel on this CPU."""
    return not PREFERRED_AWAY_FROM & cpu_extension.cpu_flags()


def takes(q_rows: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """Whether these inputs fit the loop: bfloat16, rows contiguous, head dim a multiple of 64."""
    return (
        q_rows.dtype == torch.bfloat16
        and k_cache.dtype == torch.bfloat16
        and q_rows.shape[-1] % HEAD_DIM_MULTIPLE == 0
        and k_cache.stride(2) == 1
        and v_cache.stride(2) == 1
    )


def selective_attention(
    module,
    q_rows: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    row_positions: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """q_rows [Hq, N, D] attend to cache rows j <= row_positions[i] of k_cache, v_cache
    [Hkv, T, D]; any row order. Returns [Hq, N, D]. `module`: the compiled kernels."""
    return by_position(
        q_rows, row_positions, lambda q, positions: module.bf16_flash(q, k_cache, v_cache, positions.tolist(), scale)
    )
