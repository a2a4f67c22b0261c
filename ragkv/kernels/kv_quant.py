"""Integer quantisation of chunk K/V [layers, kv_heads, T, head_dim], KIVI's way.

Keys have outlier *channels* (a few dimensions are large for every token), so a key
group shares one scale per channel across a run of tokens; values have no such
structure and are grouped per token across channels. Both are asymmetric: each group
stores a float16 scale and minimum, and a code c in [0, 2^bits - 1] means
``minimum + c * scale``.

4-bit codes pack two per byte: the low nibble holds dimension j, the high nibble
dimension j + head_dim/2. That is exactly the pair rotate-half RoPE mixes, so the
placement kernel (:mod:`kernels.place_kv`) rotates the two halves of one byte without
any interleaving.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from ragkv.kernels.checks import require

Grouping = Literal["tokens", "channels"]
BITS = (4, 8)
_SCALE_FLOOR = 2.0**-20  # a constant group still gets a non-zero scale, exact in float16


@dataclass(frozen=True)
class QuantizedKV:
    """Codes plus per-group float16 scale and minimum of one [L, H, T, D] tensor.

    ``grouping="tokens"``: scale/minimum are [L, H, ceil(T/group), D] (per channel,
    one group per `group` consecutive tokens, the last one possibly shorter).
    ``grouping="channels"``: [L, H, T, D/group] (per token, `group` channels each), or
    [L, 1, T, 1] when `group` is H*D: one group per token and layer, across its KV heads.
    """

    codes: torch.Tensor
    scale: torch.Tensor
    minimum: torch.Tensor
    bits: int
    grouping: Grouping
    group: int

    def __post_init__(self) -> None:
        require(self.bits in BITS, f"bits must be one of {BITS}, got {self.bits}")
        require(self.grouping in ("tokens", "channels"), f"unknown grouping {self.grouping!r}")
        require(self.codes.dtype == torch.uint8 and self.codes.dim() == 4, "codes must be a 4-D uint8 tensor")
        require(self.scale.shape == self.minimum.shape, "scale and minimum must have one shape")
        require(
            self.scale.shape == self._group_shape(),
            f"scale must have shape {self._group_shape()}, got {tuple(self.scale.shape)}",
        )

    @property
    def shape(self) -> tuple[int, int, int, int]:
        layers, heads, tokens, width = self.codes.shape
        return layers, heads, tokens, width * (8 // self.bits)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.codes, self.scale, self.minimum))

    def to(self, device: torch.device | str) -> QuantizedKV:
        moved = (t.to(device) for t in (self.codes, self.scale, self.minimum))
        return QuantizedKV(*moved, self.bits, self.grouping, self.group)

    def group_slices(self) -> list[tuple[slice, slice]]:
        """Per token group: (its tokens, its scale rows); one pair for channel grouping."""
        tokens = self.shape[2]
        if self.grouping == "channels":
            return [(slice(0, tokens), slice(0, tokens))]
        return [
            (slice(start, min(start + self.group, tokens)), slice(index, index + 1))
            for index, start in enumerate(range(0, tokens, self.group))
        ]

    def _group_shape(self) -> tuple[int, ...]:
        layers, heads, tokens, dim = self.shape
        if self.grouping == "tokens":
            return (layers, heads, -(-tokens // self.group), dim)
        if self.group == heads * dim and heads > 1:
            return (layers, 1, tokens, 1)
        return (layers, heads, tokens, dim // self.group)


def quantize(x: torch.Tensor, bits: int, grouping: Grouping, group: int) -> QuantizedKV:
    """Quantise x [L, H, T, D] (any float dtype); round to nearest, clamped to the range."""
    require(x.dim() == 4 and x.is_floating_point(), f"x must be a 4-D float tensor, got {tuple(x.shape)} {x.dtype}")
    require(bits in BITS, f"bits must be one of {BITS}, got {bits}")
    require(group >= 1, f"group must be >= 1, got {group}")
    dim = x.shape[3]
    require(bits == 8 or dim % 2 == 0, "4-bit codes need an even head_dim")
    across_heads = grouping == "channels" and group == x.shape[1] * dim and x.shape[1] > 1
    if grouping == "channels" and not across_heads:
        require(dim % group == 0, f"a channel group ({group}) must divide head_dim ({dim}) or be kv_heads x head_dim")
    levels = (1 << bits) - 1
    x = x.float()
    codes = torch.empty(x.shape, dtype=torch.uint8, device=x.device)
    if grouping == "tokens":
        scales, minima = [], []
        for start in range(0, x.shape[2], group):
            block = x[:, :, start : start + group]
            scale, minimum = _range(block.amin(2, keepdim=True), block.amax(2, keepdim=True), levels)
            codes[:, :, start : start + group] = _codes(block, scale, minimum, levels)
            scales.append(scale)
            minima.append(minimum)
        scale, minimum = torch.cat(scales, dim=2), torch.cat(minima, dim=2)
    elif across_heads:
        scale, minimum = _range(x.amin((1, 3), keepdim=True), x.amax((1, 3), keepdim=True), levels)
        codes.copy_(_codes(x, scale, minimum, levels))
    else:
        grouped = x.unflatten(3, (dim // group, group))
        scale, minimum = _range(grouped.amin(4, keepdim=True), grouped.amax(4, keepdim=True), levels)
        codes.copy_(_codes(grouped, scale, minimum, levels).flatten(3))
        scale, minimum = scale.squeeze(4), minimum.squeeze(4)
    if bits == 4:
        half = dim // 2
        codes = codes[..., :half] | (codes[..., half:] << 4)
    return QuantizedKV(
        codes.contiguous(), scale.half().contiguous(), minimum.half().contiguous(), bits, grouping, group
    )


def code_halves(codes: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(dimensions [0, D/2), dimensions [D/2, D)) of the codes, as float32."""
    if bits == 4:
        return (codes & 0x0F).float(), (codes >> 4).float()
    half = codes.shape[-1] // 2
    return codes[..., :half].float(), codes[..., half:].float()


def _range(low: torch.Tensor, high: torch.Tensor, levels: int) -> tuple[torch.Tensor, torch.Tensor]:
    # Round scale and minimum to their stored float16 first, so the codes are chosen
    # against exactly the grid the reader will use.
    minimum = low.half().float()
    scale = ((high - minimum) / levels).clamp_min(_SCALE_FLOOR).half().float()
    return scale, minimum


def _codes(x: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor, levels: int) -> torch.Tensor:
    return ((x - minimum) / scale).round_().clamp_(0, levels).to(torch.uint8)
