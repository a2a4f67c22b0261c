"""`a2ats`: a shared query-aware VQ codebook over pre-RoPE keys, queried with WRoPE.

WRoPE: for keys outside the recent window the relative position is replaced by a fixed
offset b, so q_t . k_i ~ (R(b) q_pre) . k_pre: the key side no longer depends on its
position and one code per (layer, KV head, token) of its pre-RoPE key suffices. A step
rotates the query by b once, scores it against the C centroids (a [Hkv, G, C] table)
and looks every candidate row's score up through its code. Keys inside the window are
attended exactly anyway.

Mean-key correction (option mean_key, default on): with k = m + r (m the calibration mean
pre-RoPE key of the layer/head), q . R(p) k = q . R(p) m + q . R(p) r. The first term
is computed EXACTLY for every row from its true position (it needs no per-row state:
one [rows, D] x [D, G] product against a [cos | sin] table of positions); only the
residual goes through WRoPE and the codes. On SmolLM2-135M plain WRoPE loses most
of the positional signal (strict recall collapses at a 6% budget); the exact mean-key term
is what brings it back (measured by `ragkv bench sparse`). With
mean key off and head_aggregation='logits' the score is a pure table lookup and runs
in kernels.code_score_topk.

Rerank (option rerank, default 2): the codes pick rerank x k candidates and the k kept
are those with the most exact attention mass among them, which reads the candidates' keys
but not their values; it lifts recall of the oracle's mass well above what the codes alone
reach (BENCHMARKS.md).

On the CPU the whole selection runs inside the compiled decode step
(`compiled_plan` hands it this request's state; ragkv/kernels/cpu/a2ats.h), with this
class as its reference; an observer or SnapKV-evicted rows keep the Python loop.

Codes come from the chunk store when the chunk was encoded with the active codebook;
rows a fusion recomputed at a layer (their K/V are new), the prefix, the question and
decoded rows get fresh codes from their cached keys rotated back by their position.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from ragkv.engine.kv_cache import KVCache
from ragkv.kernels import code_score_topk, dispatch
from ragkv.sparse.base import RowBuffer, Selector, SelectorOptions
from ragkv.sparse.codebook import A2ATSCodebook
from ragkv.sparse.prompt import PromptState, unrotate_keys

TILE_CENTROIDS = 16
"""Centroids per tile of the compiled step's layout (kTileCentroids in a2ats.h)."""

ROTATIONS_AHEAD = 64
"""Decode steps whose WRoPE rotations are computed in one call."""


def centroid_tiles(codebook: A2ATSCodebook, mean_key: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The scoring centroids in the compiled step's layout: tiles [L, Hkv, C / 16, D, 16] int8
    (coordinate d of 16 centroids side by side, C zero-padded to a multiple of 16), so that
    a step's table streams them contiguously, and their scales [L, Hkv, C padded] float32.
    Built once per codebook and kept."""

    def build() -> tuple[torch.Tensor, torch.Tensor]:
        centroids = codebook.scoring_centroids(mean_key)
        layers, heads, size, dim = centroids.codes.shape
        padding = -size % TILE_CENTROIDS
        codes = torch.nn.functional.pad(centroids.codes, (0, 0, 0, padding))
        scales = torch.nn.functional.pad(centroids.scales, (0, padding))
        return codes.view(layers, heads, -1, TILE_CENTROIDS, dim).transpose(3, 4).contiguous(), scales

    return codebook.derived(("centroid tiles", mean_key), build)


@dataclass(frozen=True)
class KeptPlan:
    """The compiled step's plan of a request, kept while the codes buffer and the rotary
    table it was built on are the selector's (both are replaced when they grow)."""

    codes: torch.Tensor
    rotary: torch.Tensor
    plan: object


@dataclass(frozen=True)
class A2ATSOptions(SelectorOptions):
    name: ClassVar[str] = "a2ats"
    needs_codebook: ClassVar[bool] = True
    default_head_aggregation: ClassVar[str] = "logits"
    """On the CPU the summed logits make the compiled step much faster than 'probs' (no
    exponentials per row), at a recall that still clears the goal and the same answers
    within noise (BENCHMARKS.md)."""
    mean_key: bool = True
    """Score the calibration mean key with its exact RoPE and only the residual (k - mean)
    with WRoPE; False = plain WRoPE on the whole key (the paper's form)."""
    rerank: float = 2.0
    """0 = off. Otherwise the codes pick rerank x k candidates and the k kept are the ones
    with the most exact attention mass among them: a step then also reads the keys
    (not the values) of (rerank - 1) x k rows beyond the budget. Default 2: the smallest
    factor whose recall of the oracle's mass clears the goal with a margin (`ragkv bench
    sparse`, BENCHMARKS.md)."""

    def __post_init__(self) -> None:
        if self.rerank != 0 and not (self.rerank >= 1 and math.isfinite(self.rerank)):
            raise ValueError(f"a2ats rerank must be 0 (off) or a finite factor >= 1, got {self.rerank}")


class A2ATS(Selector, options=A2ATSOptions):
    options: A2ATSOptions

    def prepare(self, prompt: PromptState, codebook: A2ATSCodebook | None) -> None:
        if codebook is None:
            raise ValueError("the a2ats selector needs an A2ATS codebook for this model: run `ragkv calibrate` first")
        codebook.check_model(self.spec)
        self.codebook = codebook.on(self.model.device)
        self._rotation: tuple[int, torch.Tensor, torch.Tensor] | None = None
        self._plan: KeptPlan | None = None
        self._table: torch.Tensor | None = None
        self._rows: torch.Tensor | None = None
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
                    layer, unrotate_keys(self.model, keys, fresh_rows)
                )
        self.codes = RowBuffer(codes)
        self.buffers.append(self.codes)

    @property
    def centroids_t(self) -> torch.Tensor:
        """[L, Hkv, D, C] float32 (the Python scores' table is one bmm against it), built once
        per codebook and shared by its requests."""
        mean_key = self.options.mean_key
        return self.codebook.derived(
            ("scoring centroids transposed", mean_key),
            lambda: self.codebook.scoring_centroids(mean_key).values().transpose(2, 3).contiguous(),
        )

    def extend(self, layer: int, cache: KVCache, start: int, end: int) -> None:
        heads = self.spec.num_kv_heads
        keys = cache.keys[layer, :, start:end]
        pre = unrotate_keys(self.model, keys, self.positions.of(layer, start, end, heads).to(keys.device))
        self.codes.write(layer, start, self.codebook.encode_layer(layer, pre))

    def compiled_plan(self, cache: KVCache):
        """The compiled step's plan (codes, tables; kept across steps, see KeptPlan) with this
        step's span and WRoPE row set; its a2ats_attention does what `select` and the shared
        attention do here (every option of this selector). None where only the Python loop
        applies (an observer, SnapKV-evicted rows)."""
        if self.observer is not None or self.positions.table is not None or self.model.device.type != "cpu":
            return None
        module = dispatch.compiled()
        if module is None:
            return None
        spans = self.compiled_spans(cache)
        if len(spans) != 1:
            return None
        start, end, k = spans.pop()
        candidates = self.candidates(start, end, k) if self.options.rerank else k
        rotary = self.rotary_rows(end)
        if self._plan is None or self._plan.codes is not self.codes.data or self._plan.rotary is not rotary:
            mean = self.codebook.key_mean if self.options.mean_key else self.codebook.key_mean.new_empty(0)
            tiles, scales = centroid_tiles(self.codebook, self.options.mean_key)
            self._plan = KeptPlan(
                self.codes.data,
                rotary,
                module.A2atsPlan(self.codes.data, tiles, scales, mean, rotary, self.config.aggregation == "logits"),
            )
        cos, sin, row = self.wrope_rotations(cache)
        self._plan.plan.step(cos, sin, row, start, end, k, candidates)
        return self._plan.plan

    def compiled_spans(self, cache: KVCache) -> set[tuple[int, int, int]]:
        """The distinct step spans of every layer. A layer's span depends only on the cache
        length and its `ready` rows, so while every layer is as ready as layer 0 after its
        span (no extension this step) they share it: one call instead of one per layer, whose
        Python overhead a step pays with cold caches."""
        before = self.ready[0]
        first = self.step_span(0, cache)
        if self.ready[0] == before and all(ready == before for ready in self.ready):
            return {first}
        return {first} | {self.step_span(layer, cache) for layer in range(1, self.spec.num_layers)}

    def wrope_rotation(self, cache: KVCache) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [1, D] (float32) of relative position b - p, p the token being decoded."""
        cos, sin, row = self.wrope_rotations(cache)
        return cos[row : row + 1], sin[row : row + 1]

    def wrope_rotations(self, cache: KVCache) -> tuple[torch.Tensor, torch.Tensor, int]:
        """(cos, sin [ROTATIONS_AHEAD, D] float32, row): the rotations of ROTATIONS_AHEAD
        steps, of which `row` is the token being decoded's."""
        position = self.current_position(cache)
        first = None if self._rotation is None else self._rotation[0]
        if first is None or not 0 <= position - first < ROTATIONS_AHEAD:
            # the next ROTATIONS_AHEAD steps' rotations in one call: a call's fixed cost is a visible share of a step
            relative = self.codebook.offset - torch.arange(
                position, position + ROTATIONS_AHEAD, device=self.model.device
            )
            cos, sin = self.model.rotary.cos_sin(relative)
            self._rotation = (position, cos.float().contiguous(), sin.float().contiguous())
        first, cos, sin = self._rotation
        return cos, sin, position - first

    def wrope_query(self, q: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """Every query head rotated to relative position b: R(b - p) q_post = R(b) q_pre, [Hq, D]."""
        cos, sin = self.wrope_rotation(cache)
        x1, x2 = q[:, 0].chunk(2, dim=-1)
        return q[:, 0] * cos + torch.cat((-x2, x1), dim=-1) * sin

    def select(self, layer: int, q: torch.Tensor, cache: KVCache, start: int, end: int, k: int) -> torch.Tensor:
        if self.options.rerank:
            rows = self.approximate_rows(layer, q, cache, start, end, self.candidates(start, end, k))
            return self.exact_rerank(layer, q, cache, start, end, rows, k)
        return self.approximate_rows(layer, q, cache, start, end, k)

    def candidates(self, start: int, end: int, k: int) -> int:
        """How many rows of [start, end) the codes pick for the rerank to keep k of."""
        return min(end - start, math.ceil(self.options.rerank * k))

    def approximate_rows(
        self, layer: int, q: torch.Tensor, cache: KVCache, start: int, end: int, k: int
    ) -> torch.Tensor:
        """The k rows [Hkv, k] the codes score highest."""
        if self.config.aggregation == "probs" or self.options.mean_key:
            return super().select(layer, q, cache, start, end, k)
        # plain WRoPE, scores summed over the group: a pure table lookup (the kernel's op)
        heads = self.spec.num_kv_heads
        query = self.wrope_query(q, cache).reshape(heads, self.spec.group_size, -1).sum(1)
        table = torch.bmm(query.float().unsqueeze(1), self.centroids_t[layer]).squeeze(1)  # [Hkv, C]
        _, rows = code_score_topk(table, self.codes.rows(layer, start, end), k, backend=self.config.backend)
        return rows + start

    def head_scores(self, layer: int, q: torch.Tensor, cache: KVCache, start: int, end: int) -> torch.Tensor:
        """[Hkv, G, n]; with head_aggregation='logits' the group is summed first ([Hkv, 1, n],
        the same sum, G times cheaper). The scale is folded into the query once, so every
        per-row term comes out scaled; everything per row is one gather and one GEMM."""
        heads = self.spec.num_kv_heads
        if self.config.aggregation == "logits":
            q = q.reshape(heads, self.spec.group_size, 1, -1).sum(1)  # [Hkv, 1, D]: one summed query per KV head
        group = q.shape[0] // heads
        query = q.float() * self.model.scale
        rotated = self.wrope_query(query, cache).reshape(heads, group, -1)
        table = torch.bmm(rotated, self.centroids_t[layer])  # [Hkv, G, C]
        codes = self.codes.rows(layer, start, end).long()
        scores = torch.gather(table, 2, codes.unsqueeze(1).expand(heads, group, codes.shape[1]))
        if self.options.mean_key:
            self.add_mean_key_term(scores, layer, query, start, end)
        return scores

    def add_mean_key_term(self, scores: torch.Tensor, layer: int, q: torch.Tensor, start: int, end: int) -> None:
        """scores [Hkv, G, n] += q_g . R(p_t) mean_key for rows [start, end) with their true
        positions p_t (q: [Hkv * G, 1, D], G the query heads scored per KV head).

        Per rotation pair i with the mean key's (x_i, y_i) and the query's (q1_i, q2_i):
        q . R(p) m = sum_i cos(p w_i)(q1 x + q2 y)_i + sin(p w_i)(q2 x - q1 y)_i, one small
        GEMM against the rows' [cos | sin] table (a function of position only), kept
        transposed ([D, positions]) so the product streams along positions.
        """
        heads, half = self.spec.num_kv_heads, self.spec.head_dim // 2
        group = q.shape[0] // heads
        mean = self.codebook.key_mean[layer].repeat_interleave(group, 0)  # [heads * group, D]
        q1, q2 = q[:, 0].split(half, dim=-1)
        x, y = mean.split(half, dim=-1)
        coefficients = torch.cat((q1 * x + q2 * y, q2 * x - q1 * y), dim=-1)  # [Hq, D]
        if self.positions.table is None:  # rows are positions
            scores.view(heads * group, end - start).addmm_(coefficients, self.rotary_table(end)[:, start:end])
            return
        positions = self.positions.of(layer, start, end, heads)  # per-head positions after eviction
        table = self.rotary_table(int(positions.max()) + 1).T[positions]  # [Hkv, n, D]
        scores.baddbmm_(coefficients.view(heads, group, -1), table.transpose(1, 2))

    def rotary_table(self, positions: int) -> torch.Tensor:
        """[cos | sin] of every rotation pair at positions [0, positions), transposed:
        [D, positions] (the Python scores' layout; grown on demand)."""
        if self._table is None or self._table.shape[1] < positions:
            self._table = self._rotary(self._grown(positions, self._table, 1)).T.contiguous()
        return self._table

    def rotary_rows(self, positions: int) -> torch.Tensor:
        """The same table position-major, [positions, D] (the compiled step's layout: it reads
        one position's row per tile of rows), for at least positions 0..63 (its tile)."""
        positions = max(positions, 64)
        if self._rows is None or self._rows.shape[0] < positions:
            self._rows = self._rotary(self._grown(positions, self._rows, 0))
        return self._rows

    @staticmethod
    def _grown(positions: int, table: torch.Tensor | None, axis: int) -> int:
        """Size of a table grown to hold `positions` (doubling, so growth is amortised)."""
        return max(positions, 2 * (0 if table is None else table.shape[axis]))

    def _rotary(self, size: int) -> torch.Tensor:
        """[size, D] float32: [cos | sin] of every rotation pair at positions [0, size)."""
        cos, sin = self.model.rotary.cos_sin(torch.arange(size, device=self.model.device))
        half = self.spec.head_dim // 2
        return torch.cat((cos[:, :half], sin[:, :half]), dim=-1).float().contiguous()

    @property
    def fixed_bytes(self) -> int:
        """The codebook, and the rotary [cos | sin] table (a function of position only)."""
        table = sum(t.nbytes for t in (self._table, self._rows) if t is not None)
        return self.codebook.centroids.nbytes + self.codebook.transform.nbytes + self.codebook.key_mean.nbytes + table
