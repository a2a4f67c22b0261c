"""`pqcache`: per-request product quantisation of the post-prefill keys.

After the prefill, each layer and KV head splits the head dimension into m sub-spaces
and fits 2**bits centroids per sub-space by k-means (bounded iterations, on at most
`train_rows` sampled keys); every key is stored as m codes. A step's score of a row
is the inner product (MIPS) of the query with the key's reconstruction: sum over
sub-spaces of q_m . centroid_m[code_m], a [Hkv, G, m, C] table looked up per code (with
head_aggregation='logits', the group-summed query's [Hkv, m, C] table in
kernels.code_score_topk). Keys are post-RoPE (the cache's own), so no position handling
is needed; decoded rows are encoded with the same centroids as they leave the window.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from ragkv.engine.kv_cache import KVCache
from ragkv.kernels import code_score_topk
from ragkv.sparse.base import RowBuffer, Selector, SelectorOptions
from ragkv.sparse.kmeans import kmeans, nearest
from ragkv.sparse.prompt import PromptState


@dataclass(frozen=True)
class PQCacheOptions(SelectorOptions):
    name: ClassVar[str] = "pqcache"
    subspaces: int = 2
    """m: sub-spaces the head dimension is split into (must divide it)."""
    bits: int = 6
    """Bits per sub-space code (2**bits centroids)."""
    iterations: int = 10
    """k-means iterations (bounded; the fit runs once per request after the prefill)."""
    train_rows: int = 4096
    """At most this many keys per layer and KV head train the k-means (all are encoded)."""
    seed: int = 0
    """Seed of the per-request k-means initialisation."""

    def __post_init__(self) -> None:
        if self.subspaces < 1:
            raise ValueError("pqcache subspaces must be >= 1")
        if not 1 <= self.bits <= 15:
            raise ValueError("pqcache bits must be in [1, 15] (codes are int16)")
        if self.iterations < 1 or self.train_rows < 2:
            raise ValueError("pqcache iterations must be >= 1 and train_rows >= 2")


class PQCache(Selector, options=PQCacheOptions):
    options: PQCacheOptions

    def prepare(self, prompt: PromptState, codebook) -> None:
        spec, config = self.spec, self.options
        m = config.subspaces
        if spec.head_dim % m:
            raise ValueError(f"pqcache subspaces ({m}) must divide head_dim ({spec.head_dim})")
        self.sub_dim = spec.head_dim // m
        clusters = 2**config.bits
        generator = torch.Generator().manual_seed(config.seed)
        rows, heads = prompt.length, spec.num_kv_heads
        centroids, codes = [], []
        for layer in range(spec.num_layers):
            keys = self._split(prompt.cache.keys[layer, :, :rows])  # [Hkv*m, T, d]
            train = keys
            if rows > config.train_rows:
                sample = torch.randperm(rows, generator=generator)[: config.train_rows].to(keys.device)
                train = keys[:, sample]
            fitted, _ = kmeans(train, clusters, config.iterations, generator)
            centroids.append(fitted.view(heads, m, clusters, self.sub_dim))
            codes.append(self._encode(keys, fitted))
        self.centroids = torch.stack(centroids)  # [L, Hkv, m, C, d]
        self.codes = RowBuffer(torch.stack(codes))  # [L, Hkv, T, m]
        self.buffers.append(self.codes)

    def _split(self, keys: torch.Tensor) -> torch.Tensor:
        """[Hkv, n, D] -> [Hkv * m, n, d] float32 (one k-means problem per head and sub-space)."""
        heads, n, _ = keys.shape
        m = self.options.subspaces
        return keys.float().reshape(heads, n, m, self.sub_dim).permute(0, 2, 1, 3).reshape(heads * m, n, self.sub_dim)

    def _encode(self, split_keys: torch.Tensor, centroids: torch.Tensor) -> torch.Tensor:
        """[Hkv*m, n, d] against [Hkv*m, C, d] -> codes [Hkv, n, m] int16."""
        heads, m = self.spec.num_kv_heads, self.options.subspaces
        assignment = nearest(split_keys, centroids)  # [Hkv*m, n]
        return assignment.view(heads, m, -1).transpose(1, 2).to(torch.int16)

    def extend(self, layer: int, cache: KVCache, start: int, end: int) -> None:
        centroids = self.centroids[layer].reshape(-1, *self.centroids.shape[-2:])
        self.codes.write(layer, start, self._encode(self._split(cache.keys[layer, :, start:end]), centroids))

    def select(self, layer: int, q: torch.Tensor, cache: KVCache, start: int, end: int, k: int) -> torch.Tensor:
        if self.config.aggregation == "probs":
            return super().select(layer, q, cache, start, end, k)
        # scores summed over the group: the group-summed query's table, looked up by the kernel
        heads, m = self.spec.num_kv_heads, self.options.subspaces
        query = self.group_query(q).float().view(heads, m, 1, self.sub_dim)
        table = (self.centroids[layer] * query).sum(-1)  # [Hkv, m, C]: q_m . centroid
        _, rows = code_score_topk(table, self.codes.rows(layer, start, end), k, backend=self.config.backend)
        return rows + start

    def head_scores(self, layer: int, q: torch.Tensor, cache: KVCache, start: int, end: int) -> torch.Tensor:
        heads, group, m = self.spec.num_kv_heads, self.spec.group_size, self.options.subspaces
        query = q[:, 0].float().view(heads, group, m, self.sub_dim)
        table = torch.einsum("hgmd,hmcd->hgmc", query, self.centroids[layer])  # [Hkv, G, m, C]
        codes = self.codes.rows(layer, start, end).long()  # [Hkv, n, m]
        n = codes.shape[1]
        scores = torch.gather(table[:, :, 0], 2, codes[:, :, 0].unsqueeze(1).expand(heads, group, n))
        for sub in range(1, m):
            scores = scores + torch.gather(table[:, :, sub], 2, codes[:, :, sub].unsqueeze(1).expand(heads, group, n))
        return scores * self.model.scale

    @property
    def fixed_bytes(self) -> int:
        return self.centroids.nbytes
