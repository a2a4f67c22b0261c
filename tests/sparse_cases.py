"""Synthetic cases for the sparse decode tests: a structured cache with "needle" rows, and
(sparse, dense) decode logits at a budget covering every row. Tiny models come from
tests/tiny_models.py (`make_tiny_model("llama-sparse", ...)`)."""

from __future__ import annotations

import math

import torch

from ragkv.engine.kv_cache import KVCache
from ragkv.engine.model import CausalLM


def structured_case(model: CausalLM, rows: int, seed: int = 0, needles: float = 0.05):
    """A cache whose pre-RoPE keys are Gaussian noise plus, on a few 'needle' rows, a strong
    component along a per-(layer, head) direction u in the low-frequency RoPE dims
    (which rotate little), and a decode query aligned with u. Returns (cache, pre-RoPE
    keys [L, Hkv, T, D], query maker, question queries per layer [Hq, Nq, D])."""
    spec = model.spec
    g = torch.Generator().manual_seed(seed)
    layers, heads, d = spec.num_layers, spec.num_kv_heads, spec.head_dim
    half = d // 2
    low = [half - 2, half - 1, d - 2, d - 1]  # the two lowest-frequency rotation pairs
    u = torch.zeros(layers, heads, d)
    u[..., low] = torch.randn(layers, heads, len(low), generator=g)
    u = u / u.norm(dim=-1, keepdim=True)
    keys = torch.randn(layers, heads, rows, d, generator=g) * 0.5
    needle = torch.rand(layers, heads, rows, generator=g) < needles
    strength = 3.0 + torch.rand(layers, heads, rows, generator=g) * 3.0
    keys = keys + (needle * strength).unsqueeze(-1) * u.unsqueeze(2)
    cache = model.new_cache(rows + 8)
    positions = torch.arange(rows)
    for layer in range(layers):
        cache.keys[layer, :, :rows] = model.rotary.rotate(keys[layer], positions)
        cache.values[layer, :, :rows] = torch.randn(heads, rows, d, generator=g)
    cache.length = cache.next_position = rows

    def query(layer_seed: int = 0) -> list[torch.Tensor]:
        """Post-RoPE decode queries [Hq, 1, D] per layer, at position `rows` (the next token)."""
        qg = torch.Generator().manual_seed(1000 + layer_seed)
        out = []
        for layer in range(layers):
            pre = u[layer].repeat_interleave(spec.group_size, 0) * 4.0 * math.sqrt(d)
            pre = pre + torch.randn(pre.shape, generator=qg) * 0.3
            out.append(model.rotary.rotate(pre.unsqueeze(1), torch.tensor([rows])))
        return out

    question = []
    for layer in range(layers):
        pre = u[layer].repeat_interleave(spec.group_size, 0).unsqueeze(1) * 4.0 * math.sqrt(d)
        pre = pre + torch.randn(spec.num_heads, 16, d, generator=g) * 0.3
        question.append(model.rotary.rotate(pre, torch.arange(rows - 16, rows)))
    return cache, keys, query, question


def copy_cache(cache: KVCache, extra: int = 8) -> KVCache:
    return cache.clone(extra_capacity=extra)


def full_budget_and_dense(model, ids: torch.Tensor, codebook, selector: str, steps: int = 3):
    """(sparse, dense) logits of `steps` greedy decode steps after a prefill of `ids`, the
    sparse side through `selector` at a budget covering every row."""
    from ragkv.sparse import PromptState, SparseConfig

    rows = ids.numel()
    cache = model.new_cache(rows + 8)
    token = int(model.prefill(ids, cache).argmax())
    dense_cache, sparse_cache = cache.clone(4), cache.clone(4)
    attention = SparseConfig(selector=selector, budget=1.0, window=8).build(
        PromptState.from_prefill(model, sparse_cache, ids, 2, rows - 8), codebook
    )
    pairs = []
    for _ in range(steps):
        dense = model.decode_step(token, dense_cache)
        pairs.append((model.decode_step(token, sparse_cache, attention), dense))
        token = int(dense.argmax())
    return pairs
