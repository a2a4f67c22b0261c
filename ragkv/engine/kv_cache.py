"""Per-request KV buffers, preallocated and written in place.

transformers' DynamicCache concatenates on every decode step and so copies the whole cache
each token; here rows are written into a buffer sized for the request and grown by
doubling only when a request outgrows its estimate.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ragkv.engine.model_spec import ModelSpec


@dataclass
class KVCache:
    """Post-RoPE keys and values of every layer: [layers, kv_heads, capacity, head_dim].

    `length` rows are valid. `next_position` is the RoPE position of the next token; it
    equals `length` until rows are evicted (SnapKV), after which rows keep the rotation of
    the position they were computed at.
    """

    keys: torch.Tensor
    values: torch.Tensor
    length: int = 0
    next_position: int = 0

    @classmethod
    def allocate(cls, spec: ModelSpec, capacity: int, dtype: torch.dtype, device: torch.device | str) -> KVCache:
        shape = (spec.num_layers, spec.num_kv_heads, max(capacity, 1), spec.head_dim)
        return cls(torch.empty(shape, dtype=dtype, device=device), torch.empty(shape, dtype=dtype, device=device))

    @property
    def capacity(self) -> int:
        return self.keys.shape[2]

    def reserve(self, rows: int) -> None:
        """Make room for `rows` rows in total, doubling the buffer when it must grow."""
        if rows <= self.capacity:
            return
        new_capacity = max(rows, 2 * self.capacity)
        for name in ("keys", "values"):
            old = getattr(self, name)
            grown = old.new_empty(old.shape[:2] + (new_capacity,) + old.shape[3:])
            grown[:, :, : self.length] = old[:, :, : self.length]
            setattr(self, name, grown)

    def layer(self, layer: int, rows: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Views of one layer's first `rows` (default: all valid) rows: [kv_heads, rows, head_dim]."""
        end = self.length if rows is None else rows
        return self.keys[layer, :, :end], self.values[layer, :, :end]

    def truncate(self, length: int) -> None:
        """Forget rows past `length` (an exact prefix stays valid)."""
        if length > self.length:
            raise ValueError(f"cannot truncate a cache of {self.length} rows to {length}")
        self.length = length
        self.next_position = length

    def clone(self, extra_capacity: int = 0) -> KVCache:
        """A copy of the valid rows with room for `extra_capacity` more (chat turns fork from this)."""
        rows = self.length + extra_capacity
        keys = self.keys.new_empty(self.keys.shape[:2] + (max(rows, 1),) + self.keys.shape[3:])
        values = torch.empty_like(keys)
        keys[:, :, : self.length] = self.keys[:, :, : self.length]
        values[:, :, : self.length] = self.values[:, :, : self.length]
        return KVCache(keys, values, self.length, self.next_position)
