"""Dense decode attention for a batch of requests, each over its own KV cache.

One call per layer serves every running request of a decode step: request b's query
heads [Hq, D] attend to the first lengths[b] rows of its cache layer [Hkv, capacity, D]
(GQA: query head h reads KV head h // (Hq / Hkv)). On the CPU the compiled kernel
(`cpu/attention.h`) spreads (request, KV head, row block) items over the threads and
reads a bfloat16 cache without widening it in memory; on a GPU the split-K Triton kernel
of sparse decode runs over each request's leading rows; the torch path loops over
requests.
"""

from __future__ import annotations

import torch

from ragkv.kernels import cpu_extension, reference, torch_cpu
from ragkv.kernels.checks import FLOAT_DTYPES, check_dtype, require
from ragkv.kernels.dispatch import Backend, compiled, select_backend


def _cpp_supports(q: torch.Tensor, keys: list[torch.Tensor]) -> bool:
    return (
        keys[0].dtype in cpu_extension.CACHE_DTYPES
        and cpu_extension.supports_heads(q.shape[1], keys[0].shape[0], q.shape[2])
        and all(k.stride(2) == 1 for k in keys)
    )


def decode_attention(
    q: torch.Tensor,
    keys: list[torch.Tensor],
    values: list[torch.Tensor],
    lengths: list[int],
    scale: float,
    *,
    backend: Backend = "auto",
) -> torch.Tensor:
    """softmax(q_b K_b^T * scale) V_b for each request b.

    Args:
        q: [B, Hq, D] float32/float16/bfloat16.
        keys, values: B tensors [Hkv, capacity_b, D] of one dtype (the cache's), rows
            contiguous; keys and values of a request laid out alike.
        lengths: B ints, 1 <= lengths[b] <= capacity_b.
        scale: softmax scale, usually 1/sqrt(D).
        backend: "auto", "torch", "triton" or "cpp" (CPU, float32/bfloat16 caches).

    Returns [B, Hq, D] in q's dtype.
    """
    check_dtype("q", q, FLOAT_DTYPES)
    require(q.dim() == 3, f"q must be [B, Hq, D], got {tuple(q.shape)}")
    batch, heads, dim = q.shape
    require(
        len(keys) == batch and len(values) == batch and len(lengths) == batch,
        f"need one key, value and length per request ({batch}), got {len(keys)}, {len(values)}, {len(lengths)}",
    )
    kv_heads, dtype = keys[0].shape[0], keys[0].dtype
    require(kv_heads > 0 and heads % kv_heads == 0, f"Hq ({heads}) must be a multiple of Hkv ({kv_heads})")
    for b, (k, v, length) in enumerate(zip(keys, values, lengths)):
        require(
            k.dim() == 3 and k.shape[0] == kv_heads and k.shape[2] == dim,
            f"keys[{b}] must be [Hkv={kv_heads}, rows, D={dim}], got {tuple(k.shape)}",
        )
        require(v.shape == k.shape and v.stride() == k.stride(), f"values[{b}] must be laid out like keys[{b}]")
        require(k.dtype == dtype and v.dtype == dtype, "every cache must share one dtype")
        require(1 <= length <= k.shape[1], f"lengths[{b}] = {length} outside [1, {k.shape[1]}]")
    device = q.device
    kernels = ("triton", "cpp") if _cpp_supports(q, keys) else ("triton",)
    chosen = select_backend("decode_attention", backend, device, kernels=kernels)
    if chosen == "triton":
        from ragkv.kernels.triton.sparse_attention import launch_decode

        return torch.stack(
            [launch_decode(q[b], keys[b], values[b], None, length, None, scale)[0] for b, length in enumerate(lengths)]
        )
    if chosen == "cpp":
        out = compiled().decode_attention(q.float().contiguous(), keys, values, list(lengths), scale)
        return out.to(q.dtype)
    if device.type == "cpu":
        return torch_cpu.decode_attention(q, keys, values, lengths, scale)
    return reference.decode_attention(q, keys, values, lengths, scale)
