"""Attention for an arbitrary subset of query rows against a full KV cache.

Selective recompute re-runs only the ~15% of prompt tokens whose cached KV
deviates most after chunk concatenation; those rows still attend causally to
every earlier cache row, which is what this op computes.
"""

from __future__ import annotations

import math

import torch

from ragkv.kernels import bf16_flash, cpu_extension, cpu_flash, torch_cpu
from ragkv.kernels.checks import FLOAT_DTYPES, INDEX_DTYPES, check_dtype, check_shape, common_device, require
from ragkv.kernels.dispatch import Backend, compiled, select_backend


def _tile_sizes(dtype: torch.dtype, head_dim: int) -> tuple[int, int]:
    """(BLOCK_M, BLOCK_N) that compile without register spills for sm_90.

    Chosen from ``ptxas -v`` at num_warps=4: float32 inputs use "ieee" FMA dots,
    whose working set is far larger than 16-bit tensor-core dots, and head dims
    above 128 double every tile.
    """
    if dtype == torch.float32:
        return (32, 32) if head_dim <= 128 else (16, 16)
    return (64, 32) if head_dim <= 128 else (32, 32)


def _kernels(q_rows: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[str, ...]:
    """The accelerated backends for these inputs: Triton always, the compiled bf16 flash loop
    for bfloat16 caches with contiguous rows and head_dim a multiple of 64, torch's CPU flash
    kernel for bfloat16 caches with contiguous rows, the compiled CPU kernel for
    float32/bfloat16 caches with contiguous rows and head_dim a multiple of 16."""
    rows_contiguous = k_cache.stride(2) == 1 and v_cache.stride(2) == 1
    flash = k_cache.dtype == torch.bfloat16 and rows_contiguous
    cpp = (
        k_cache.dtype in cpu_extension.CACHE_DTYPES
        and q_rows.shape[2] % 16 == 0
        and cpu_extension.supports_heads(q_rows.shape[0], k_cache.shape[0], q_rows.shape[2])
        and k_cache.stride(2) == 1
        and v_cache.stride() == k_cache.stride()
    )
    own = ("bf16_flash",) if bf16_flash.takes(q_rows, k_cache, v_cache) else ()
    return ("triton",) + own + (("cpu_flash",) if flash else ()) + (("cpp",) if cpp else ())


def reads_cache_in_place(q_rows: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """Whether backend "auto" runs a CPU kernel that reads a bfloat16 cache as stored (the
    compiled one widens it in registers, the flash ones multiply bfloat16 and accumulate in
    float32), so callers need not widen it."""
    return _auto(q_rows, k_cache, v_cache) in ("bf16_flash", "cpu_flash", "cpp")


def takes_whole_prefills(q_rows: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """Whether backend "auto" runs a kernel that should also take a causal prefill from row
    0 (rows = cache rows), in place of torch's fused causal SDPA: the bf16 flash loop, which
    outruns that kernel where it runs."""
    return _auto(q_rows, k_cache, v_cache) == "bf16_flash"


def _auto(q_rows: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> str:
    return select_backend("selective_attention", "auto", q_rows.device, _kernels(q_rows, k_cache, v_cache))


def selective_attention(
    q_rows: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    row_positions: torch.Tensor,
    scale: float,
    *,
    backend: Backend = "auto",
) -> torch.Tensor:
    """Causal-by-position attention for selected query rows.

    Args:
        q_rows: [Hq, N, D]; Hq = Hkv * group, query head h reads KV head h // group.
        k_cache, v_cache: [Hkv, T, D], same dtype as q_rows; cache row j holds position j.
        row_positions: [N] int, absolute position of each query row, in [0, T)
            (precondition, unchecked); any order, duplicates allowed.
        scale: softmax scale, usually 1/sqrt(D).
        backend: "auto", "torch", "triton", "bf16_flash" (CPU built for AVX512-BF16;
            bfloat16 caches, head_dim a multiple of 64), "cpu_flash" (CPU; bfloat16 caches)
            or "cpp" (CPU; float32/bfloat16 caches, head_dim a multiple of 16).

    Returns out [Hq, N, D] in q_rows' dtype: row i attends to rows j <= row_positions[i].
    """
    check_dtype("q_rows", q_rows, FLOAT_DTYPES)
    check_dtype("row_positions", row_positions, INDEX_DTYPES)
    require(q_rows.dim() == 3, f"q_rows must be [Hq, N, D], got {tuple(q_rows.shape)}")
    require(k_cache.dim() == 3, f"k_cache must be [Hkv, T, D], got {tuple(k_cache.shape)}")
    hq, n, d = q_rows.shape
    hkv, t, _ = k_cache.shape
    check_shape("k_cache", k_cache, (hkv, t, d))
    check_shape("v_cache", v_cache, (hkv, t, d))
    check_shape("row_positions", row_positions, (n,))
    require(
        k_cache.dtype == q_rows.dtype and v_cache.dtype == q_rows.dtype,
        "q_rows, k_cache and v_cache must share a dtype",
    )
    require(hkv > 0 and t > 0 and hq % hkv == 0, f"need T > 0 and Hq ({hq}) a multiple of Hkv ({hkv})")
    device = common_device(q_rows=q_rows, k_cache=k_cache, v_cache=v_cache, row_positions=row_positions)

    chosen = select_backend("selective_attention", backend, device, kernels=_kernels(q_rows, k_cache, v_cache))
    if chosen == "torch":
        return torch_cpu.selective_attention(q_rows, k_cache, v_cache, row_positions, scale)
    if chosen == "bf16_flash":
        return bf16_flash.selective_attention(compiled(), q_rows, k_cache, v_cache, row_positions, scale)
    if chosen == "cpu_flash":
        return cpu_flash.selective_attention(q_rows, k_cache, v_cache, row_positions, scale)
    if chosen == "cpp":
        limits = (row_positions.long() + 1).tolist()
        out = compiled().selective_attention(q_rows.transpose(0, 1), k_cache, v_cache, limits, scale)
        return out.transpose(0, 1).to(q_rows.dtype)

    import triton

    from ragkv.kernels.triton.selective_attention import selective_attention_kernel

    out = torch.empty((hq, n, d), dtype=q_rows.dtype, device=device)
    if n == 0:
        return out
    # int32 positions keep the kernel's loop bound the same type as its counter.
    positions = row_positions.int()
    block_m, block_n = _tile_sizes(q_rows.dtype, d)
    grid = (triton.cdiv(n, block_m), hq)
    selective_attention_kernel[grid](
        q_rows,
        k_cache,
        v_cache,
        positions,
        out,
        float(scale) * math.log2(math.e),
        n,
        t,
        d,
        hq // hkv,
        *q_rows.stride(),
        *k_cache.stride(),
        *v_cache.stride(),
        *positions.stride(),
        *out.stride(),
        DOT_PRECISION="ieee" if q_rows.dtype == torch.float32 else "tf32",
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_D=triton.next_power_of_2(d),
    )
    return out
