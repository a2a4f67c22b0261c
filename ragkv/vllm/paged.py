"""Reading and writing token rows of one layer of vLLM's paged KV cache, whatever the
attention backend's layout.

vLLM gives a connector each layer's cache as a logical [blocks, kv_heads, block_rows,
content] view (`vllm.v1.kv_cache_layout`); what `content` holds, and where a token's key
and value sit inside a block, is the backend's own business (the CPU backend puts a
block's keys first and its values after them, inside a [heads, 2 * block_rows, head_dim]
run; FlashAttention splits K and V on another axis). So nothing here assumes it:

- rows are WRITTEN with the backend's own cache update (`impl.do_kv_cache_update`, the call
  vLLM itself makes for every new token), given [tokens, kv_heads, head_dim] K and V and
  their slots;
- rows are READ through a map found once per layer shape by asking that same update to
  write one block of coded values into a scratch block and looking where each landed.

A backend that quantises its cache (fp8) cannot be mapped this way: the probe refuses it.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

WriteRows = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]
"""(keys [T, H, D], values [T, H, D], cache, slots [T] int64): the backend's cache update."""

_EXACT_INTEGER_BITS = {torch.float32: 24, torch.float16: 11, torch.bfloat16: 8, torch.float64: 53}


def slots_of(block_ids: list[int] | torch.Tensor, block_size: int, start: int, end: int) -> torch.Tensor:
    """Slots (block id * block_size + offset) of token positions [start, end) of a request
    whose blocks (vLLM's scheduler block size) are `block_ids`."""
    blocks = torch.as_tensor(block_ids, dtype=torch.int64)
    positions = torch.arange(start, end, dtype=torch.int64)
    return blocks[positions // block_size] * block_size + positions % block_size


class PagedLayout:
    """Where the elements of one block's K and V rows live in a layer's cache."""

    def __init__(self, write: WriteRows, cache: torch.Tensor, num_kv_heads: int, head_dim: int):
        if cache.dtype not in _EXACT_INTEGER_BITS:
            raise ValueError(f"the connector cannot map a {cache.dtype} KV cache (a quantised cache is not a copy)")
        self.write = write
        self.block_rows = cache.shape[2]
        self.num_kv_heads, self.head_dim = num_kv_heads, head_dim
        self.block_elements = math.prod(cache.shape[1:])
        self.key_index, self.value_index = self._probe(cache)

    def _probe(self, cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        rows, heads, dim = self.block_rows, self.num_kv_heads, self.head_dim
        count = rows * heads * dim
        codes = torch.arange(1, 2 * count + 1, dtype=torch.int64)  # 0 = never written
        bits = min(_EXACT_INTEGER_BITS[cache.dtype] - 1, 20)
        base = 1 << bits
        found = torch.zeros(self.block_elements, dtype=torch.int64)
        scale = 1
        remaining = codes.clone()
        slots = torch.arange(rows, dtype=torch.int64, device=cache.device)
        while True:
            digit = remaining % base
            scratch = torch.zeros_like(cache[:1])
            keys = digit[:count].view(rows, heads, dim).to(cache.dtype).to(cache.device)
            values = digit[count:].view(rows, heads, dim).to(cache.dtype).to(cache.device)
            self.write(keys, values, scratch, slots)
            found += scratch[0].reshape(-1).to(torch.int64).cpu() * scale
            remaining = remaining // base
            if int(remaining.max()) == 0:
                break
            scale *= base
        where = torch.full((2 * count + 1,), -1, dtype=torch.int64)
        written = found > 0
        if int(found.max()) > 2 * count or int(written.sum()) != 2 * count:
            raise ValueError("the attention backend's cache update is not an element copy; cannot map its layout")
        where[found[written]] = torch.nonzero(written).flatten()
        if int((where[1:] < 0).sum()):
            raise ValueError("the attention backend's cache update dropped elements; cannot map its layout")
        return where[1 : count + 1].view(rows, heads * dim), where[count + 1 :].view(rows, heads * dim)

    def read(self, cache: torch.Tensor, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values [kv_heads, T, head_dim] of the tokens at `slots` [T]."""
        slots = slots.to(torch.int64).cpu()
        blocks = slots // self.block_rows
        unique, local = torch.unique(blocks, return_inverse=True)
        flat = cache[unique.to(cache.device)].reshape(-1)
        base = (local * self.block_elements).to(cache.device)[:, None]
        offsets = (slots % self.block_rows).to(cache.device)
        shape = (len(slots), self.num_kv_heads, self.head_dim)
        keys = flat[base + self.key_index.to(cache.device)[offsets]].view(shape)
        values = flat[base + self.value_index.to(cache.device)[offsets]].view(shape)
        return keys.transpose(0, 1), values.transpose(0, 1)

    def write_rows(self, cache: torch.Tensor, slots: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Write keys and values [kv_heads, T, head_dim] (post-RoPE) at `slots` [T]."""
        device = cache.device
        self.write(
            keys.transpose(0, 1).to(device=device, dtype=cache.dtype).contiguous(),
            values.transpose(0, 1).to(device=device, dtype=cache.dtype).contiguous(),
            cache,
            slots.to(device),
        )
