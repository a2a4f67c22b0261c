"""`a2ats`: a shared query-aware VQ codebook over pre-RoPE keys, queried with WRoPE.

WRoPE: for keys outside the recent window the relative position is replaced by a fixed
offset b, so q_t . k_i ~ (R(b) q_pre) . k_pre: the key side no longer depends on its
position and one code per (layer, KV head, token) of its pre-RoPE key suffices. A step
rotates the group-summed query by b once, scores it against the C centroids
(a [Hkv, C] table) and looks every candidate row's score up through its code
(kernels.code_score_topk). Keys inside the window are attended exactly anyway.

Codes come from the chunk store when the chunk was encoded with the active codebook;
rows a fusion recomputed at a layer (their K/V are new), the prefix, the question and
decoded rows get fresh codes from their cached keys rotated back by their position.
"""

from __future__ import annotations

import torch

from kernels import code_score_topk
from ragkv.kv_cache import KVCache
from ragkv.sparse.base import RowBuffer, Selector
from ragkv.sparse.codebook import A2ATSCodebook
from ragkv.sparse.prompt import PromptState, unrotate_keys


class A2ATS(Selector):
    name = "a2ats"

    def prepare(self, prompt: PromptState, codebook: A2ATSCodebook | None) -> None:
        if codebook is None:
            raise ValueError("the a2ats selector needs an A2ATS codebook for this model: run `ragkv calibrate` first")
        codebook.check_model(self.spec)
        self.codebook = codebook.to(self.model.device) if codebook.centroids.device != self.model.device else codebook
        self._rotation: tuple[int, torch.Tensor, torch.Tensor] | None = None
        layers, heads, rows = self.spec.num_layers, self.spec.num_kv_heads, prompt.length
        codes = torch.zeros((layers, heads, rows), dtype=torch.int16, device=self.model.device)
        for layer in range(layers):
            fresh = torch.ones(rows, dtype=torch.bool)
            for (start, end), stored in zip(prompt.chunk_spans, prompt.chunk_codes):
                if stored is not None:
                    codes[layer, :, start:end] = stored[layer].to(codes.device)
                    fresh[start:end] = False
            if prompt.recomputed_rows is not None:
                fresh[prompt.recomputed_rows(layer).cpu()] = True
            else:
                fresh[:] = True
            fresh_rows = fresh.nonzero().flatten()
            if fresh_rows.numel():
                keys = prompt.cache.keys[layer][:, fresh_rows.to(self.model.device)]
                codes[layer][:, fresh_rows.to(codes.device)] = self.codebook.encode_layer(
                    layer, unrotate_keys(self.model, keys, fresh_rows))
        self.codes = RowBuffer(codes)
        self.buffers.append(self.codes)

    def extend(self, layer: int, cache: KVCache, start: int, end: int) -> None:
        heads = self.spec.num_kv_heads
        keys = cache.keys[layer, :, start:end]
        pre = unrotate_keys(self.model, keys, self.positions.of(layer, start, end, heads).to(keys.device))
        self.codes.write(layer, start, self.codebook.encode_layer(layer, pre))

    def wrope_query(self, q: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """The group-summed query rotated to relative position b: R(b - p) q_post = R(b) q_pre."""
        position = self.current_position(cache)
        if self._rotation is None or self._rotation[0] != position:  # once per step, not per layer
            cos, sin = self.model.rotary.cos_sin(torch.tensor([self.codebook.offset - position], device=q.device))
            self._rotation = (position, cos, sin)
        _, cos, sin = self._rotation
        summed = self.group_query(q)  # rotation is linear: rotating the sum = summing the rotations
        x1, x2 = summed.chunk(2, dim=-1)
        return summed * cos + torch.cat((-x2, x1), dim=-1) * sin

    def select(self, layer: int, q: torch.Tensor, cache: KVCache, start: int, end: int, k: int) -> torch.Tensor:
        table = self.codebook.centroid_scores(layer, self.wrope_query(q, cache))
        _, rows = code_score_topk(table, self.codes.rows(layer, start, end), k, backend=self.config.backend)
        return rows + start

    @property
    def fixed_bytes(self) -> int:
        return self.codebook.centroids.nbytes + self.codebook.transform.nbytes
