"""Passages pasted into a prompt, reused from the chunk store wherever they stand.

    plan     (store reads, no model; lookup.py)   prompt ids past the reused prefix ─►
             SpanFinder: passage spans ─► their chunk keys and the prompt's anchors
             ─► PassagePlan: the spans, and the rows the store gives (Placed): passages
             stored whole, and the stretches other stored passages share with this prompt
    prepare  (model, no store reads)   prefill the text before the first passage onto the
             prefix cache, then the request's fusion strategy over
             [prefix | passages (placed rows: stored K/V at their position; the rest fresh)
             | question: everything after the last passage] ─► first token; the new rows
             of each passage packed for the store as a run, with its anchor records
    commit   (store writes)            the runs and anchors put into the store: the next
             prompt holding any stretch of them reuses it

`prepare_prompt` is the recipe, the one every front end calls (chat turns, completions,
the vLLM connector): plan, prepare, commit. The three stay separate methods so the store
reads can run ahead of the model step (a plan handed in is not looked up again).

A passage's new rows are computed in place with every row before it (not alone after the
precompute prefix as ingestion computes a chunk): a prompt whose passages are all new
then costs one full prefill and gives its exact answer, and what the store keeps of each
passage knows the context it was first read in (ARCHITECTURE.md, "Passages in any prompt").
Only rows no stored run holds are stored: a stretch two prompts share is kept once.
A run is a chunk without a document: same key space, tenant salt and store capacity.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from ragkv.app.calibrated import Calibrated
from ragkv.app.passages.anchors import AnchorConfig, AnchorRecord, anchor_positions
from ragkv.app.passages.counters import SpanCounters
from ragkv.app.passages.finder import SpanConfig
from ragkv.app.passages.keys import SpanKeys
from ragkv.app.passages.lookup import PassageLookup
from ragkv.app.passages.plan import PassagePlan
from ragkv.app.usage import TokenUsage
from ragkv.engine import Engine
from ragkv.engine.kv_cache import KVCache
from ragkv.fusion import FusionInput, FusionResult, FusionStrategy, LoadedChunk
from ragkv.store.base import ChunkStore
from ragkv.store.keys import ChunkKey

log = logging.getLogger("ragkv.app.passages")


@dataclass
class FusedPassages:
    """A prompt with its passages fused: what `PromptPassages.prepare_prompt` gives."""

    fusion: FusionResult
    plan: PassagePlan
    """The passages' spans and the stored rows placed among them."""
    usage: TokenUsage
    """Its `computed_tokens`: the prompt rows computed here (not placed from the store or a prefix cache)."""
    strategy: str = ""
    """The fusion strategy's name."""
    writes: list[tuple[ChunkKey, dict]] = field(default_factory=list)
    """New passages' blobs for the store (`PromptPassages.commit` puts them)."""
    written_tokens: int = 0
    prefill_s: float = 0.0
    """Seconds prefilling the text before the first passage."""
    fuse_s: float = 0.0

    @property
    def cache(self) -> KVCache:
        """The fused prompt's rows (and room for what follows)."""
        return self.fusion.cache


class PromptPassages:
    """Finds, loads, fuses and stores the passages of prompts for one engine and store."""

    def __init__(
        self,
        engine: Engine,
        store: ChunkStore,
        config: SpanConfig = SpanConfig(),
        share_across_tenants: bool = False,
        anchors: AnchorConfig = AnchorConfig(),
        calibrated: Calibrated | None = None,
    ):
        self.engine = engine
        self.store = store
        self.calibrated = calibrated or Calibrated()
        self.keys = SpanKeys(engine.tokenizer, engine.fingerprint, config, share_across_tenants)
        self.finder = self.keys.finder
        self.anchors = anchors
        self.lookup = PassageLookup(self.keys, store, engine.kv_format, anchors)
        self.counters = SpanCounters()

    # -- the recipe: plan, prepare, commit ------------------------------------------------

    def prepare_prompt(
        self,
        tenant: str,
        token_ids: list[int],
        strategy: FusionStrategy,
        extra_capacity: int,
        *,
        plan: PassagePlan | None = None,
        prefix_cache: KVCache | None = None,
    ) -> FusedPassages | None:
        """The one way a prompt's passages are reused (chat turns, completions, the vLLM
        connector): its plan (store reads; `plan` when it was looked up already, as a chat
        turn's is past its cached prefix), the fusion (model: `prepare`), then its new
        passages stored (`commit`). None when the prompt holds no passage."""
        plan = plan if plan is not None else self.plan(tenant, token_ids, 0)
        if plan is None:
            return None
        fused = self.prepare(token_ids, plan, strategy, extra_capacity, prefix_cache)
        self.commit(fused)
        return fused

    # -- plan: store reads ------------------------------------------------------------

    def plan(self, tenant: str, token_ids: list[int], start: int) -> PassagePlan | None:
        """The passages in token_ids[start:] and the rows the store gives (None: no passage)."""
        plan = self.lookup.plan(tenant, token_ids, start)
        if plan is not None:
            self.counters.add_plan(plan)
        return plan

    # -- prepare: the model -----------------------------------------------------------

    def prepare(
        self,
        token_ids: list[int],
        plan: PassagePlan,
        strategy: FusionStrategy,
        extra_capacity: int,
        prefix_cache: KVCache | None = None,
    ) -> FusedPassages:
        """Fuse token_ids with the plan's passages. `prefix_cache` holds the prompt's first
        rows (a cached conversation; None: none); the text from its end to the first
        passage is prefilled onto it, and the fusion is built inside it (grown as needed)."""
        model = self.engine.model
        first = plan.first
        cache = prefix_cache if prefix_cache is not None else model.new_cache(first)
        if cache.length > first:
            raise ValueError("the prefix cache holds rows past the first passage")
        started = time.perf_counter()
        computed_before = first - cache.length
        if computed_before:
            model.prefill(torch.tensor(token_ids[cache.length : first]), cache)
        prefill_s = time.perf_counter() - started
        fusion = strategy.fuse(model, self._fusion_input(token_ids, plan), cache, extra_capacity, in_place=True)
        writes, tokens = self._new_passages(plan, fusion)
        fuse_s = time.perf_counter() - started - prefill_s
        usage = TokenUsage.of_fusion(fusion, computed_before)
        return FusedPassages(fusion, plan, usage, strategy.name, writes, tokens, prefill_s, fuse_s)

    def _fusion_input(self, token_ids: list[int], plan: PassagePlan) -> FusionInput:
        """[prefix | placed rows and the fresh rows between them | question]; fresh rows are
        cut at span edges so each new passage's rows can be stored apart."""
        first, last = plan.first, plan.last
        cuts = sorted({first, last, *(e for s in plan.spans for e in (s.start, s.end))})
        chunks: list[LoadedChunk] = []
        position = first
        for piece in plan.placed:
            chunks += _fresh(token_ids, position, piece.start, cuts)
            chunks.append(LoadedChunk(token_ids[piece.start : piece.end], piece.keys, piece.values))
            position = piece.end
        chunks += _fresh(token_ids, position, last, cuts)
        return FusionInput(token_ids[:first], chunks, token_ids[last:], len(self.engine.chunk_prefix_ids), None)

    def _new_passages(self, plan: PassagePlan, fusion: FusionResult) -> tuple[list[tuple[ChunkKey, dict]], int]:
        """The runs of new rows of the plan's spans (from the fusion's fresh rows), each with
        its anchor records."""
        if fusion.fresh_kv is None:
            return [], 0
        index = {row: i for i, row in enumerate(fusion.layout.fresh_rows.tolist())}
        ids = fusion.layout.token_ids
        writes, tokens, seen = [], 0, set()
        for span in plan.spans:
            for start, end in plan.uncovered(span):
                if end - start < self.anchors.min_run or start not in index or end - 1 not in index:
                    continue
                run_ids = ids[start:end].tolist()
                digest = self.keys.chunk_keys.digest(plan.tenant, run_ids)
                if digest in seen:
                    continue
                seen.add(digest)
                rows = slice(index[start], index[end - 1] + 1)
                keys, values = fusion.fresh_kv[0][:, :, rows], fusion.fresh_kv[1][:, :, rows]
                writes += self.stored_run(plan.tenant, run_ids, keys, values, digest)
                tokens += end - start
        return writes, tokens

    def stored_run(
        self, tenant: str, run_ids: list[int], keys: torch.Tensor, values: torch.Tensor, digest: str | None = None
    ) -> list[tuple[ChunkKey, dict]]:
        """What the store keeps of a run of prompt rows, whoever computed them (this fusion,
        or vLLM through the connector): its blob under its chunk key, and its anchor
        records. `keys` are pre-RoPE, [layers, H, len, D]."""
        digest = digest or self.keys.chunk_keys.digest(tenant, run_ids)
        blob = self.engine.stored_chunk(run_ids, keys, values, self.calibrated.codebook)
        return [(self.keys.chunk_keys.key(tenant, digest), blob), *self._anchor_records(tenant, run_ids, digest)]

    def _anchor_records(self, tenant: str, run_ids: list[int], digest: str) -> list[tuple[ChunkKey, dict]]:
        window = self.anchors.window
        positions = anchor_positions(np.asarray(run_ids, dtype=np.int64), self.anchors).tolist()
        return [
            (self.keys.chunk_keys.anchor(tenant, run_ids[p - window + 1 : p + 1]), AnchorRecord(digest, p).tensors())
            for p in positions
        ]

    # -- commit: store writes ---------------------------------------------------------

    def commit(self, fused: FusedPassages) -> None:
        """Put the new passages of a fused prompt into the store (a cache fill: a store that
        cannot take it drops it)."""
        if fused.writes:
            self.store.put_many([(key, blob, None) for key, blob in fused.writes])
        self.counters.add_stored(fused.written_tokens)
        fused.writes = []


def _fresh(token_ids: list[int], start: int, end: int, cuts: list[int]) -> list[LoadedChunk]:
    """Fresh chunks over [start, end), cut at `cuts`."""
    bounds = [start, *(c for c in cuts if start < c < end), end]
    return [LoadedChunk(token_ids[a:b]) for a, b in zip(bounds, bounds[1:]) if b > a]
