"""The one place that picks the kernel of a linear layer.

A `Linear` is built from a checkpoint weight [out, in] for a `Numerics`: a dense matrix for
many rows (prefill) and, when the decode format differs, a second kernel for few rows
(decode), where the step is bound by reading the weights and a packed int8/int4 matrix
reads 4-8x fewer bytes than float32. Callers pass activations in any float dtype and get
the same dtype back.
"""

from __future__ import annotations

import torch

from ragkv.engine.decode_weights import PackedWeight
from ragkv.engine.numerics import DTYPES, Numerics
from ragkv.kernels import dispatch

DECODE_ROWS = 16
"""Row counts up to this use the decode kernel (decode steps and batches); more use the dense one."""

INT4_GROUP_SIZE = 32
INT4_SCALE_SLOTS = 8
"""Scales per row are padded to a multiple of this (the compiled kernel converts 8 at a time)."""
INT4_INNER_K_TILES = 2


PACKED_ACTIVATION_DTYPE = torch.bfloat16
"""Activations of torch's packed int8/int4 CPU kernels: they are vectorised for bf16 and
not for float32, where they are many times slower even on CPUs without bf16 units
(BENCHMARKS.md); CPUs with AVX512-BF16 gain more."""


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

    def packed(self) -> PackedWeight:
        """The weights as the compiled decode step takes them (shared, not copied)."""
        return PackedWeight(self.weight, self.scales)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int8pack_mm(x.to(self.dtype), self.weight, self.scales).to(x.dtype)


class Int4Kernel:
    """int4 in groups of INT4_GROUP_SIZE input columns, each with a float16 scale d and
    minimum m (w = q * d + m, q in 0..15): a GGUF Q4_1 checkpoint's blocks exactly.

    The rows are packed for the compiled kernel (`ragkv/kernels/cpu/int4_linear.h`), which
    quantizes the activations to int8 in the same groups and multiplies in integers. Where
    the compiled kernels cannot be built, torch's packed int4 kernel runs on bf16
    activations (its scale and zero rounded to bf16), built on first use."""

    def __init__(self, weight: torch.Tensor):
        out_features, in_features = weight.shape
        if in_features % INT4_GROUP_SIZE:
            raise ValueError(f"int4 weights need in_features divisible by {INT4_GROUP_SIZE}, got {in_features}")
        self.in_features = in_features
        groups = weight.float().view(out_features, in_features // INT4_GROUP_SIZE, INT4_GROUP_SIZE)
        low = groups.amin(-1).half()
        scale = ((groups.amax(-1) - low.float()) / 15).half()
        steps = (groups - low.float()[..., None]) / scale.float()[..., None]
        codes = torch.where(scale[..., None] > 0, steps.round().clamp(0, 15), torch.zeros_like(steps)).to(torch.uint8)
        self.rows = pack_int4_rows(codes, scale, low)
        self._torch_packed: tuple[torch.Tensor, torch.Tensor] | None = None

    @classmethod
    def from_rows(cls, rows: torch.Tensor, in_features: int) -> Int4Kernel:
        """A kernel over rows already packed (a GGUF's own Q4_0/Q4_1 blocks: no second rounding)."""
        kernel = cls.__new__(cls)
        kernel.in_features, kernel.rows, kernel._torch_packed = in_features, rows.contiguous(), None
        return kernel

    def packed(self) -> PackedWeight:
        """The rows as the compiled decode step takes them (their scales inside, so none apart)."""
        return PackedWeight(self.rows, self.rows.new_empty(0))

    def dequantized(self) -> torch.Tensor:
        """The weight [out, in] float32 the packed rows hold."""
        codes, scale, low = unpack_int4_rows(self.rows, self.in_features)
        return (codes.float() * scale.float()[..., None] + low.float()[..., None]).flatten(1)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        module = dispatch.compiled()
        if module is not None:
            return module.int4_linear(x.float().contiguous(), self.rows, self.in_features).to(x.dtype)
        packed, scale_and_zero = self._torch_kernel()
        return torch.ops.aten._weight_int4pack_mm_for_cpu(
            x.to(PACKED_ACTIVATION_DTYPE), packed, INT4_GROUP_SIZE, scale_and_zero
        ).to(x.dtype)

    def _torch_kernel(self) -> tuple[torch.Tensor, torch.Tensor]:
        """torch's layout: w = (q - 8) * scale + zero, so zero = m + 8 d."""
        if self._torch_packed is None:
            codes, scale, low = unpack_int4_rows(self.rows, self.in_features)
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(
                codes.flatten(1).to(torch.int32).contiguous(), INT4_INNER_K_TILES
            )
            zero = low.float() + 8 * scale.float()
            scale_and_zero = torch.stack((scale.float(), zero), dim=-1).transpose(0, 1).contiguous()
            self._torch_packed = (packed, scale_and_zero.to(PACKED_ACTIVATION_DTYPE))
        return self._torch_packed


def _int4_row_sizes(in_features: int) -> tuple[int, int, int]:
    """(groups, block pairs, scale slots) of one packed row (int4_linear.h's layout)."""
    groups = in_features // INT4_GROUP_SIZE
    return groups, (groups + 1) // 2, -(-groups // INT4_SCALE_SLOTS) * INT4_SCALE_SLOTS


def pack_int4_rows(codes: torch.Tensor, scale: torch.Tensor, low: torch.Tensor) -> torch.Tensor:
    """codes [out, groups, 32] uint8 (0..15), scale and low [out, groups] float16 -> rows
    [out, bytes] uint8: the codes of block pairs (block 2p in the low nibbles, 2p + 1 in the
    high), then the scales, then the minimums, each padded with zeros to whole slots."""
    out_features, groups, _ = codes.shape
    _, pairs, slots = _int4_row_sizes(groups * INT4_GROUP_SIZE)
    padded = torch.zeros(out_features, 2 * pairs, INT4_GROUP_SIZE, dtype=torch.uint8)
    padded[:, :groups] = codes
    padded = padded.view(out_features, pairs, 2, INT4_GROUP_SIZE)
    nibbles = (padded[:, :, 0] | (padded[:, :, 1] << 4)).flatten(1)

    def slots_of(values: torch.Tensor) -> torch.Tensor:
        held = torch.zeros(out_features, slots, dtype=torch.float16)
        held[:, :groups] = values
        return held.view(torch.uint8)

    return torch.cat((nibbles, slots_of(scale), slots_of(low)), dim=1).contiguous()


def unpack_int4_rows(rows: torch.Tensor, in_features: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The inverse of `pack_int4_rows`: codes [out, groups, 32], scale and low [out, groups]."""
    groups, pairs, slots = _int4_row_sizes(in_features)
    nibbles = rows[:, : 32 * pairs].reshape(rows.shape[0], pairs, 1, INT4_GROUP_SIZE)
    codes = torch.cat((nibbles & 0x0F, nibbles >> 4), dim=2).reshape(rows.shape[0], 2 * pairs, INT4_GROUP_SIZE)
    halves = rows[:, 32 * pairs :].contiguous().view(torch.float16)
    return codes[:, :groups], halves[:, :groups], halves[:, slots : slots + groups]


def _kernel(weight: torch.Tensor, weight_format: str, int4_rows: torch.Tensor | None = None):
    if weight_format == "int8":
        return Int8Kernel(weight)
    if weight_format == "int4":
        return Int4Kernel(weight) if int4_rows is None else Int4Kernel.from_rows(int4_rows, weight.shape[1])
    return DenseKernel(weight, DTYPES[weight_format])


class Linear:
    """x [N, in] -> x @ W^T [N, out], with the kernel chosen by N and the numerics; the LM
    head takes the numerics' `lm_head_weights` for few rows. `int4_rows`, packed rows of
    `weight` exactly, serve the int4 format instead of requantising `weight`."""

    def __init__(
        self, weight: torch.Tensor, numerics: Numerics, lm_head: bool = False, int4_rows: torch.Tensor | None = None
    ):
        self.out_features = weight.shape[0]
        few_rows_format = numerics.lm_head_weights if lm_head else numerics.weights
        self.many_rows = _kernel(weight, numerics.prefill_weights)
        self.few_rows = (
            self.many_rows
            if few_rows_format == numerics.prefill_weights
            else _kernel(weight, few_rows_format, int4_rows)
        )

    def packed_decode_weight(self) -> PackedWeight | None:
        """The few-row kernel's packed int8/int4 weights; None when it is a dense matrix."""
        return self.few_rows.packed() if isinstance(self.few_rows, (Int8Kernel, Int4Kernel)) else None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return (self.few_rows if x.shape[0] <= DECODE_ROWS else self.many_rows)(x)
