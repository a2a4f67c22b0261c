"""SnapKV eviction after the first token, using the question window.

Per layer and KV head, every document row is scored by the attention the question
window gives it (the question rows' exact softmax attention over all rows, summed over
the question rows and the head's query heads), smoothed by a max-pool of kernel
`kernel` over positions; the prefix and question rows are always kept, plus the top
C - |prefix| - |question| document rows. Every head keeps the same number of rows, so
the cache stays rectangular and is compacted in place: row order is position order,
each kept key keeps the rotation of its position, and next_position does not change.

It composes with any fusion strategy (it only reads the fused cache and the question
probe) and with the selectors, which then work on the compacted cache.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ragkv.sparse.prompt import PromptState


@dataclass(frozen=True)
class SnapKV:
    capacity: int
    """C: prompt rows kept per layer and KV head."""
    kernel: int = 7
    """Max-pool kernel over positions (odd)."""

    def __post_init__(self) -> None:
        if self.capacity < 1 or self.kernel < 1 or self.kernel % 2 == 0:
            raise ValueError("SnapKV needs capacity >= 1 and an odd kernel >= 1")

    def scores(self, prompt: PromptState, layer: int) -> torch.Tensor:
        """Pooled question-window attention [Hkv, document rows] at `layer`."""
        spec, cache = prompt.model.spec, prompt.cache
        rows = cache.length
        queries = prompt.question_queries()[layer]  # [Hq, Nq, D]
        keys = cache.keys[layer, :, :rows].float()
        grouped = queries.float().reshape(spec.num_kv_heads, -1, queries.shape[1], spec.head_dim)
        logits = torch.einsum("hgnd,htd->hgnt", grouped, keys) * prompt.model.scale
        positions = torch.arange(prompt.question_start, rows, device=keys.device)
        future = torch.arange(rows, device=keys.device).unsqueeze(0) > positions.unsqueeze(1)  # [Nq, T]
        attention = logits.masked_fill(future, float("-inf")).softmax(-1).sum(dim=(1, 2))  # [Hkv, T]
        document = attention[:, prompt.prefix_len : prompt.question_start]
        return F.max_pool1d(document.unsqueeze(1), self.kernel, stride=1, padding=self.kernel // 2).squeeze(1)

    def keep_rows(self, prompt: PromptState) -> torch.Tensor:
        """Rows kept [layers, kv_heads, C'] in position order, C' = min(C, rows)."""
        spec, rows = prompt.model.spec, prompt.length
        question = rows - prompt.question_start
        fixed = prompt.prefix_len + question
        if self.capacity >= rows:
            return torch.arange(rows).expand(spec.num_layers, spec.num_kv_heads, rows).clone()
        if self.capacity < fixed:
            raise ValueError(
                f"SnapKV capacity {self.capacity} is below the prefix + question rows ({fixed}) it must keep"
            )
        budget = self.capacity - fixed
        prefix = torch.arange(prompt.prefix_len).expand(spec.num_kv_heads, -1)
        tail = torch.arange(prompt.question_start, rows).expand(spec.num_kv_heads, -1)
        kept = []
        for layer in range(spec.num_layers):
            chosen = self.scores(prompt, layer).topk(budget, dim=-1).indices.cpu() + prompt.prefix_len
            kept.append(torch.cat((prefix, chosen.sort(dim=-1).values, tail), dim=1))
        return torch.stack(kept)

    @torch.inference_mode()
    def evict(self, prompt: PromptState) -> torch.Tensor:
        """Compact prompt.cache in place; returns the kept rows [layers, kv_heads, C']."""
        kept = self.keep_rows(prompt)
        cache = prompt.cache
        if kept.shape[2] == cache.length:
            return kept
        index = kept.to(cache.keys.device).unsqueeze(-1).expand(*kept.shape, cache.keys.shape[-1])
        rows = cache.length
        for name in ("keys", "values"):
            buffer = getattr(cache, name)
            buffer[:, :, : kept.shape[2]] = torch.gather(buffer[:, :, :rows], 2, index)
        cache.length = kept.shape[2]  # next_position unchanged: kept rows keep their rotation
        return kept
