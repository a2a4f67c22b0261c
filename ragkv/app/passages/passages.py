"""Passages pasted into a prompt, reused from the chunk store wherever they stand.

    plan     (store reads, no model)   prompt ids past the reused prefix ─► SpanFinder:
             passage spans ─► ChunkKey(fingerprint, hash(tenant salt, span ids)) ─► store.get_many
             ─► PassagePlan: the spans, and the rows the store gives (Placed)
    prepare  (model, no store reads)   prefill the text before the first passage onto the
             prefix cache, then the request's fusion strategy over
             [prefix | passages (placed rows: stored K/V at their position; the rest fresh)
             | question: everything after the last passage] ─► first token; the fresh
             passage rows' pre-RoPE K/V packed for the store
    commit   (store writes)            the new passages put into the store: the next prompt
             holding one reuses it

A missed passage is computed in place with every row before it (not alone after the
precompute prefix as ingestion computes a chunk): a prompt whose passages are all new
then costs one full prefill and gives its exact answer, and what the store keeps of each
passage knows the context it was first read in (ARCHITECTURE.md, "Passages in any prompt").
A span is a chunk without a document: same key space, tenant salt and store capacity.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch

from ragkv.app.passages.counters import SpanCounters
from ragkv.app.passages.finder import SpanConfig
from ragkv.app.passages.keys import SpanKeys
from ragkv.app.passages.plan import PassagePlan, Placed
from ragkv.app.usage import TokenUsage
from ragkv.engine import Engine
from ragkv.engine.kv_cache import KVCache
from ragkv.fusion import FusionInput, FusionResult, FusionStrategy, LoadedChunk
from ragkv.store.base import ChunkStore
from ragkv.store.keys import ChunkKey

log = logging.getLogger("ragkv.app.passages")


@dataclass
class FusedPassages:
    fusion: FusionResult
    plan: PassagePlan
    usage: TokenUsage
    writes: list[tuple[ChunkKey, dict]] = field(default_factory=list)
    """New passages' blobs for the store (`PromptPassages.commit` puts them)."""
    written_tokens: int = 0
    prefill_s: float = 0.0
    """Seconds prefilling the text before the first passage."""
    fuse_s: float = 0.0


class PromptPassages:
    """Finds, loads, fuses and stores the passages of prompts for one engine and store."""

    def __init__(
        self, engine: Engine, store: ChunkStore, config: SpanConfig = SpanConfig(), share_across_tenants: bool = False
    ):
        self.engine = engine
        self.store = store
        self.keys = SpanKeys(engine.tokenizer, engine.fingerprint, config, share_across_tenants)
        self.finder = self.keys.finder
        self.counters = SpanCounters()

    # -- plan: store reads ------------------------------------------------------------

    def plan(self, tenant: str, token_ids: list[int], start: int) -> PassagePlan | None:
        """The passages in token_ids[start:] and the rows the store gives (None: no passage)."""
        found = self.keys.find(tenant, token_ids, start)
        if not found.spans:
            return None
        placed = []
        for span, digest, tensors in zip(found.spans, found.digests, self.store.get_many(found.keys)):
            if _holds(tensors, token_ids, span.start, span.end):
                keys, values = self.engine.kv_format.unpack(tensors)
                placed.append(Placed(span.start, span.end, keys, values, digest))
        plan = PassagePlan(found.spans, found.digests, placed)
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
        return FusedPassages(fusion, plan, usage, writes, tokens, prefill_s, fuse_s)

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
        """Blobs of the spans the store did not give, from the fusion's fresh rows."""
        if fusion.fresh_kv is None:
            return [], 0
        fresh = fusion.layout.fresh_rows
        index = {int(row): i for i, row in enumerate(fresh.tolist())}
        ids = fusion.layout.token_ids
        writes, tokens, seen = [], 0, set()
        for span, digest in zip(plan.spans, plan.digests):
            if digest in seen or plan.covered(span) or span.start not in index or span.end - 1 not in index:
                continue
            seen.add(digest)
            rows = slice(index[span.start], index[span.end - 1] + 1)
            keys, values = fusion.fresh_kv[0][:, :, rows], fusion.fresh_kv[1][:, :, rows]
            writes.append(
                (
                    self.keys.chunk_keys.key(digest),
                    self.engine.stored_chunk(ids[span.start : span.end].tolist(), keys, values),
                )
            )
            tokens += len(span)
        return writes, tokens

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


def _holds(tensors: dict | None, token_ids: list[int], start: int, end: int) -> bool:
    """Whether stored tensors are these rows' (the key is a hash: the ids are compared)."""
    if tensors is None:
        return False
    stored = tensors.get("tokens")
    if stored is None or stored.numel() != end - start:
        log.warning("a stored span's tokens do not match its key: recomputed")
        return False
    return stored.tolist() == token_ids[start:end]
