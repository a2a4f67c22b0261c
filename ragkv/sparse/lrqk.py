"""`lrqk`: joint low-rank query/key factors fitted on the prompt's own queries and keys.

Per layer and KV head, with Q the question window's queries of the head's group
([G * Nq, D], post-RoPE, from the question probe) and K the prompt's keys ([T, D]), the
best rank-r approximation of Q K^T is U_q X_r S_r Y_r^T U_k^T, where Q = U_q S_q V_q^T,
K = U_k S_k V_k^T and X S Y^T is the SVD of S_q V_q^T V_k S_k. It factors as
(Q W_q)(K W_k)^T with W_q = V_q S_q^-1 X_r S_r^1/2 and W_k = V_k S_k^-1 Y_r S_r^1/2,
both [D, r]. Each row stores its r key factors; a step's proxy scores are
(q_g W_q) . (k W_k) for each query head and candidate row, O(r) per row instead of O(D). The most
recent `lite` rows beyond the window are kept exact as well (the 'lite' set).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from ragkv.engine.kv_cache import KVCache
from ragkv.sparse.base import RowBuffer, Selector
from ragkv.sparse.prompt import PromptState
from ragkv.sparse.registry import SelectorOptions, register

_RELATIVE_CUTOFF = 1e-5


def _svd(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(V [D, s], S [s]) of x's economy SVD, dropping directions with negligible energy."""
    _, s, vh = torch.linalg.svd(x.double(), full_matrices=False)
    keep = s > s[0] * _RELATIVE_CUTOFF if s.numel() and s[0] > 0 else s > 0
    return vh[keep].T, s[keep]


def joint_factors(queries: torch.Tensor, keys: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """W_q, W_k [D, r'] (r' <= rank) with (Q W_q)(K W_k)^T the best rank-r' approximation of Q K^T."""
    vq, sq = _svd(queries)
    vk, sk = _svd(keys)
    middle = (sq.unsqueeze(1) * (vq.T @ vk)) * sk.unsqueeze(0)
    x, s, yh = torch.linalg.svd(middle, full_matrices=False)
    r = min(rank, s.numel())
    root = s[:r].sqrt()
    w_q = vq @ ((x[:, :r] * root) / sq.unsqueeze(1))
    w_k = vk @ ((yh[:r].T * root) / sk.unsqueeze(1))
    return w_q.float(), w_k.float()


@register
@dataclass(frozen=True)
class LRQKOptions(SelectorOptions):
    name: ClassVar[str] = "lrqk"
    rank: int = 32
    """r: rank of the joint query/key factors."""
    lite: int = 16
    """Recent rows beyond the window kept exact (the 'lite' set; counts in the budget)."""

    def __post_init__(self) -> None:
        if self.rank < 1:
            raise ValueError("lrqk rank must be >= 1")
        if self.lite < 0:
            raise ValueError("lrqk lite must be >= 0")

    def attach(self, config, prompt, codebook) -> "LRQK":
        return LRQK(config, prompt, codebook)


class LRQK(Selector):
    options: LRQKOptions

    def prepare(self, prompt: PromptState, codebook) -> None:
        spec, rank = self.spec, self.options.rank
        self.extra_recent = self.options.lite
        queries = prompt.question_queries()
        rows, heads, dim = prompt.length, spec.num_kv_heads, spec.head_dim
        w_q = torch.zeros((spec.num_layers, heads, dim, rank), device=self.model.device)
        w_k = torch.zeros_like(w_q)
        factors = torch.zeros((spec.num_layers, heads, rows, rank), dtype=self.model.dtype, device=self.model.device)
        for layer in range(spec.num_layers):
            grouped = queries[layer].reshape(heads, -1, dim)  # the group's query heads pooled
            keys = prompt.cache.keys[layer, :, :rows]
            for head in range(heads):
                fq, fk = joint_factors(grouped[head], keys[head], rank)
                w_q[layer, head, :, : fq.shape[1]] = fq
                w_k[layer, head, :, : fk.shape[1]] = fk
            factors[layer] = torch.bmm(keys.float(), w_k[layer]).to(factors.dtype)
        self.w_q, self.w_k = w_q, w_k
        self.factors = RowBuffer(factors)
        self.buffers.append(self.factors)

    def extend(self, layer: int, cache: KVCache, start: int, end: int) -> None:
        keys = cache.keys[layer, :, start:end].float()
        self.factors.write(layer, start, torch.bmm(keys, self.w_k[layer]).to(self.factors.data.dtype))

    def head_scores(self, layer: int, q: torch.Tensor, cache: KVCache, start: int, end: int) -> torch.Tensor:
        heads, group = self.spec.num_kv_heads, self.spec.group_size
        query = torch.bmm(q[:, 0].float().view(heads, group, -1), self.w_q[layer])  # [Hkv, G, r]
        factors = self.factors.rows(layer, start, end).float()  # [Hkv, n, r]
        return torch.bmm(query, factors.transpose(1, 2)) * self.model.scale

    @property
    def fixed_bytes(self) -> int:
        return self.w_q.nbytes + self.w_k.nbytes
