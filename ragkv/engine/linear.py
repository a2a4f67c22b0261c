"""The one place that picks the kernel of a linear layer.

A `Linear` is built from a checkpoint weight [out, in] for a `Numerics`: a dense matrix for
many rows (prefill) and, when the decode format differs, a second kernel for few rows
(decode), where the step is bound by reading the weights and a packed int8/int4 matrix
reads 4-8x fewer bytes than float32. Callers pass activations in any float dtype and get
the same dtype back.
"""

from __future__ import annotations

import torch

from ragkv.engine.numerics import DTYPES, Numerics

DECODE_ROWS = 16
"""Row counts up to this use the decode kernel (decode steps and batches); more use the dense one."""

INT4_GROUP_SIZE = 32
INT4_INNER_K_TILES = 2


PACKED_ACTIVATION_DTYPE = torch.bfloat16
"""Activations of torch's packed int8/int4 CPU kernels: they are vectorised for bf16 and
not for float32. SmolLM2's 30 layers for one decode row: int8 8 ms on bf16 activations
against 102 ms on float32 ones (AVX2 CPU without bf16 units, where float32 MKL took 15 ms;
BENCHMARKS.md); CPUs with AVX512-BF16 gain more."""


class DenseKernel:
    def __init__(self, weight: torch.Tensor, dtype: torch.dtype):
        self.weight_t = weight.to(dtype).t().contiguous()  # [in, out] for x @ W

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return (x.to(self.weight_t.dtype) @ self.weight_t).to(x.dtype)


class Int8Kernel:
    """Symmetric int8 per output channel; scales rounded to the activation dtype before
    quantizing, so the kernel's dequantization is exactly the quantizer's."""

    def __init__(self, weight: torch.Tensor):
        self.dtype = PACKED_ACTIVATION_DTYPE
        weight = weight.float()
        scales = (weight.abs().amax(dim=1) / 127).clamp_min(1e-12).to(self.dtype)
        self.scales = scales
        self.weight = torch.round(weight / scales.float()[:, None]).clamp(-127, 127).to(torch.int8).contiguous()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int8pack_mm(x.to(self.dtype), self.weight, self.scales).to(x.dtype)


class Int4Kernel:
    """Asymmetric int4 in groups of INT4_GROUP_SIZE input columns (torch's packed CPU layout:
    w = (q - 8) * scale + zero)."""

    def __init__(self, weight: torch.Tensor):
        out_features, in_features = weight.shape
        if in_features % INT4_GROUP_SIZE:
            raise ValueError(f"int4 weights need in_features divisible by {INT4_GROUP_SIZE}, got {in_features}")
        self.dtype = PACKED_ACTIVATION_DTYPE
        groups = weight.float().view(out_features, in_features // INT4_GROUP_SIZE, INT4_GROUP_SIZE)
        low, high = groups.amin(-1), groups.amax(-1)
        scale = ((high - low) / 15).clamp_min(1e-12)
        codes = torch.round((groups - low[..., None]) / scale[..., None]).clamp(0, 15).to(torch.int32)
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(
            codes.view(out_features, in_features).contiguous(), INT4_INNER_K_TILES
        )
        zero = low + 8 * scale
        self.scale_and_zero = torch.stack((scale, zero), dim=-1).transpose(0, 1).contiguous().to(self.dtype)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int4pack_mm_for_cpu(
            x.to(self.dtype), self.packed, INT4_GROUP_SIZE, self.scale_and_zero
        ).to(x.dtype)


def _kernel(weight: torch.Tensor, weight_format: str):
    if weight_format == "int8":
        return Int8Kernel(weight)
    if weight_format == "int4":
        return Int4Kernel(weight)
    return DenseKernel(weight, DTYPES[weight_format])


class Linear:
    """x [N, in] -> x @ W^T [N, out], with the kernel chosen by N and the numerics."""

    def __init__(self, weight: torch.Tensor, numerics: Numerics):
        self.out_features = weight.shape[0]
        self.many_rows = _kernel(weight, numerics.prefill_weights)
        self.few_rows = self.many_rows if numerics.weights == numerics.prefill_weights else _kernel(weight, numerics.weights)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return (self.few_rows if x.shape[0] <= DECODE_ROWS else self.many_rows)(x)
