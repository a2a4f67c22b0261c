"""How chunk K/V is written to the store: a float dtype, or KIVI-style integer codes.

A format turns a chunk's pre-RoPE keys and values into the named tensors of its blob
(:meth:`KVStorageFormat.pack`) and back into what placement reads
(:meth:`KVStorageFormat.unpack`: float tensors, or :class:`QuantizedKV` that the
placement kernel dequantises while rotating). The format's descriptor is part of the
model fingerprint, so a chunk stored in one format is never read as another.

Keys are grouped per channel over runs of ``key_group`` tokens, values per token over
``value_group`` channels (or all of a layer's KV heads), with a float16 scale and minimum
per group. The groups were chosen by measured first-token KL on MuSiQue dev passages
(`ragkv bench store --data ...`): int4 with 256-token key groups and one value group per
token and layer costs 5,974 bytes per token of a 512-token SmolLM2 chunk (float16: 23,044)
and adds a first-token KL of a few thousandths; smaller groups cost more bytes for little.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ragkv.kernels.kv_quant import QuantizedKV, quantize
from ragkv.kernels.reference import dequantize

StoredKV = torch.Tensor | QuantizedKV
_QUANTIZED_PARTS = ("codes", "scale", "minimum")


@dataclass(frozen=True)
class KVStorageFormat:
    name: str
    float_dtype: torch.dtype | None = None
    """Float formats: the dtype stored. None for the integer formats."""
    bits: int = 16
    key_group: int = 0
    """Integer formats: tokens that share one per-channel key scale."""
    value_group: int | None = None
    """Integer formats: channels that share one per-token value scale; None = all of a
    layer's KV heads (kv_heads x head_dim channels)."""

    @property
    def quantized(self) -> bool:
        return self.float_dtype is None

    @property
    def descriptor(self) -> str:
        """What the model fingerprint records: the float dtype's name, or bits and groups."""
        values = "layer" if self.value_group is None else self.value_group
        return self.name if not self.quantized else f"{self.name}:k{self.key_group}:v{values}"

    def pack(self, keys: torch.Tensor, values: torch.Tensor) -> dict[str, torch.Tensor]:
        """Blob tensors of a chunk's pre-RoPE keys/values [layers, kv_heads, T, head_dim]."""
        if not self.quantized:
            return {"keys": keys.to(self.float_dtype).contiguous(), "values": values.to(self.float_dtype).contiguous()}
        tensors = {}
        for name, quantized in (
            ("keys", quantize(keys, self.bits, "tokens", self.key_group)),
            ("values", quantize(values, self.bits, "channels", self._value_group(values.shape))),
        ):
            tensors.update({f"{name}.{part}": getattr(quantized, part) for part in _QUANTIZED_PARTS})
        return tensors

    def unpack(self, tensors: dict[str, torch.Tensor]) -> tuple[StoredKV, StoredKV]:
        """(keys, values) as placement reads them; ValueError if the blob is of another format."""
        if not self.quantized:
            keys, values = tensors.get("keys"), tensors.get("values")
            if keys is None or values is None or keys.dtype != self.float_dtype:
                raise ValueError(f"chunk blob is not in the {self.name} format")
            return keys, values
        try:
            keys = QuantizedKV(
                *(tensors[f"keys.{part}"] for part in _QUANTIZED_PARTS), self.bits, "tokens", self.key_group
            )
            values = QuantizedKV(
                *(tensors[f"values.{part}"] for part in _QUANTIZED_PARTS),
                self.bits,
                "channels",
                self._value_group(keys.shape),
            )
        except KeyError as exc:
            raise ValueError(f"chunk blob is not in the {self.name} format: no {exc.args[0]!r}") from exc
        return keys, values

    def _value_group(self, shape: tuple[int, ...]) -> int:
        return shape[1] * shape[3] if self.value_group is None else self.value_group

    def dense_keys(self, tensors: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        """The stored pre-RoPE keys as a float tensor (what a query reads back)."""
        keys, _ = self.unpack(tensors)
        return dense(keys, dtype)


def dense(stored: StoredKV, dtype: torch.dtype) -> torch.Tensor:
    """A stored K or V as a plain float tensor."""
    return (dequantize(stored) if isinstance(stored, QuantizedKV) else stored).to(dtype)


KV_STORAGE_FORMATS: dict[str, KVStorageFormat] = {
    "float32": KVStorageFormat("float32", torch.float32, 32),
    "float16": KVStorageFormat("float16", torch.float16, 16),
    "bfloat16": KVStorageFormat("bfloat16", torch.bfloat16, 16),
    "int8": KVStorageFormat("int8", bits=8, key_group=128, value_group=64),
    "int4": KVStorageFormat("int4", bits=4, key_group=256, value_group=None),
}


def slice_tokens(stored: StoredKV, start: int, end: int) -> StoredKV:
    """Tokens [start, end) of a stored K or V [L, H, T, D]: the part of a stored passage
    another prompt shares. Codes grouped per token are sliced as they are; codes grouped
    over runs of tokens are sliced when `start` is on a group's edge, else the groups that
    hold the tokens are dequantised (float32) and sliced."""
    tokens = stored.shape[2]
    if not 0 <= start < end <= tokens:
        raise ValueError(f"token slice [{start}, {end}) outside a stored run of {tokens}")
    if not isinstance(stored, QuantizedKV):
        return stored[:, :, start:end]
    if stored.grouping == "channels":
        rows = slice(start, end)
        return QuantizedKV(
            stored.codes[:, :, rows], stored.scale[:, :, rows], stored.minimum[:, :, rows], *_kind(stored)
        )
    group = stored.group
    first, last = start // group, -(-end // group)
    aligned = QuantizedKV(
        stored.codes[:, :, first * group : min(last * group, tokens)],
        stored.scale[:, :, first:last],
        stored.minimum[:, :, first:last],
        *_kind(stored),
    )
    if start % group == 0:
        return aligned if end == min(last * group, tokens) else _cut(aligned, end - start)
    offset = start - first * group
    return dequantize(aligned)[:, :, offset : offset + end - start]


def _kind(stored: QuantizedKV) -> tuple[int, str, int]:
    return stored.bits, stored.grouping, stored.group


def _cut(aligned: QuantizedKV, tokens: int) -> QuantizedKV:
    """The first `tokens` of a token-grouped run that starts on a group's edge (its last
    group may end up shorter, as a run's last group may be)."""
    groups = -(-tokens // aligned.group)
    return QuantizedKV(
        aligned.codes[:, :, :tokens], aligned.scale[:, :, :groups], aligned.minimum[:, :, :groups], *_kind(aligned)
    )
