"""Passages pasted into a prompt, reused from the chunk store wherever they stand.

    prompt ids past the reused prefix ─► SpanFinder (ragkv.ingest.spans): passage spans
      ─► ChunkKey(fingerprint, hash(tenant salt, span ids)) ─► store.get_many
      ─► FusionInput [prefix: everything before the first span
                      | spans (hit: stored K/V placed at its position; miss: fresh)
                        and the text between them (fresh)
                      | question: everything after the last span]
      ─► the request's fusion strategy (probe by default) ─► first token
      ─► the missed spans' pre-RoPE K/V, computed by the fusion in the prompt's own
         context, put into the store: the next prompt holding the passage reuses it

A missed span is computed in place with every row before it (not alone after the
precompute prefix as ingestion computes a chunk): a prompt whose passages are all new
then costs one full prefill and gives its exact answer, and what the store keeps of each
passage knows the context it was first read in (ARCHITECTURE.md, "Passages in any prompt").
A span is a chunk without a document: same key space, tenant salt and store capacity.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass

from ragkv.app.usage import TokenUsage
from ragkv.engine import Engine
from ragkv.engine.fingerprint import KV_FORMAT_VERSION
from ragkv.engine.kv_cache import KVCache
from ragkv.fusion import FusionInput, FusionResult, FusionStrategy, LoadedChunk
from ragkv.ingest.pipeline import chunk_key
from ragkv.ingest.spans import Span, SpanConfig, SpanFinder
from ragkv.store.base import ChunkStore
from ragkv.store.keys import ChunkKey, hash_tokens

log = logging.getLogger("ragkv.app.prompt_passages")


@dataclass(frozen=True)
class PassagePlan:
    """Where the passages of a prompt's new tokens are and which the store holds."""

    spans: list[Span]
    """Positions in the searched ids, ascending."""
    hashes: list[str]
    stored: list[dict | None]
    """Per span, its stored tensors, or None (a miss)."""

    @property
    def hits(self) -> int:
        return sum(tensors is not None for tensors in self.stored)

    @property
    def misses(self) -> int:
        return len(self.spans) - self.hits

    @property
    def reused_tokens(self) -> int:
        return sum(len(span) for span, tensors in zip(self.spans, self.stored) if tensors is not None)


@dataclass
class SpanCounters:
    """What /metrics reports of prompt spans (added under a lock, read together)."""

    hits: int = 0
    misses: int = 0
    tokens_reused: int = 0
    tokens_stored: int = 0

    def __post_init__(self) -> None:
        self._lock = threading.Lock()

    def add(self, plan: PassagePlan, stored_tokens: int) -> None:
        with self._lock:
            self.hits += plan.hits
            self.misses += plan.misses
            self.tokens_reused += plan.reused_tokens
            self.tokens_stored += stored_tokens

    def snapshot(self) -> SpanCounters:
        with self._lock:
            return SpanCounters(self.hits, self.misses, self.tokens_reused, self.tokens_stored)


@dataclass
class FusedPassages:
    fusion: FusionResult
    plan: PassagePlan
    usage: TokenUsage


class SpanKeys:
    """Where the passage spans of a prompt are and their chunk keys. Needs no model, only
    the tokenizer and the engine's fingerprint: the vLLM connector's scheduler side asks
    the store with these keys which spans it holds before any worker loads them."""

    def __init__(
        self, tokenizer, fingerprint: str, config: SpanConfig = SpanConfig(), share_across_tenants: bool = False
    ):
        self.finder = SpanFinder(tokenizer, config)
        self.fingerprint = fingerprint
        self.share_across_tenants = share_across_tenants

    def find(self, tenant: str, token_ids: list[int], start: int) -> tuple[list[Span], list[str], list[ChunkKey]]:
        """The spans in token_ids[start:], their hashes under the tenant's salt and keys."""
        # a span needs a prefix before it (the template's opening at least) to be fused into
        spans = [span for span in self.finder.spans(token_ids, start) if span.start > 0]
        namespace = "" if self.share_across_tenants else tenant
        hashes = [hash_tokens(token_ids[span.start : span.end], namespace) for span in spans]
        return spans, hashes, [ChunkKey(self.fingerprint, h, KV_FORMAT_VERSION) for h in hashes]


class PromptPassages:
    """Finds, loads, fuses and stores the passages of prompts for one engine and store."""

    def __init__(
        self, engine: Engine, store: ChunkStore, config: SpanConfig = SpanConfig(), share_across_tenants: bool = False
    ):
        self.engine = engine
        self.store = store
        self.keys = SpanKeys(engine.tokenizer, engine.fingerprint, config, share_across_tenants)
        self.finder = self.keys.finder
        self.share_across_tenants = share_across_tenants
        self.counters = SpanCounters()

    def plan(self, tenant: str, token_ids: list[int], start: int) -> PassagePlan | None:
        """The passages in token_ids[start:] (None when there are none)."""
        spans, hashes, keys = self.keys.find(tenant, token_ids, start)
        if not spans:
            return None
        stored = self.store.get_many(keys)
        checked = [tensors if _holds(tensors, token_ids, span) else None for tensors, span in zip(stored, spans)]
        return PassagePlan(spans, hashes, checked)

    def fuse(
        self,
        token_ids: list[int],
        plan: PassagePlan,
        prefix_cache: KVCache,
        strategy: FusionStrategy,
        extra_capacity: int,
        computed_before: int,
    ) -> FusedPassages:
        """Fuse token_ids (whose first prefix_cache.length rows are in `prefix_cache`,
        fused into in place) with the plan's spans; store the spans that missed."""
        first, last = plan.spans[0].start, plan.spans[-1].end
        if prefix_cache.length != first:
            raise ValueError("the prefix cache must hold every row before the first span")
        chunks: list[LoadedChunk] = []
        span_chunks: list[int] = []
        position = first
        for span, tensors in zip(plan.spans, plan.stored):
            if span.start > position:  # the text between two passages: computed here
                chunks.append(LoadedChunk(token_ids[position : span.start]))
            span_chunks.append(len(chunks))
            if tensors is None:
                chunks.append(LoadedChunk(token_ids[span.start : span.end]))
            else:
                chunks.append(LoadedChunk(token_ids[span.start : span.end], *self.engine.kv_format.unpack(tensors)))
            position = span.end
        fusion_input = FusionInput(token_ids[:first], chunks, token_ids[last:], len(self.engine.chunk_prefix_ids), None)
        fusion = strategy.fuse(self.engine.model, fusion_input, prefix_cache, extra_capacity, in_place=True)
        stored_tokens = self._store_missed(plan, fusion, span_chunks)
        self.counters.add(plan, stored_tokens)
        return FusedPassages(fusion, plan, TokenUsage.of_fusion(fusion, computed_before))

    def _store_missed(self, plan: PassagePlan, fusion: FusionResult, span_chunks: list[int]) -> int:
        items, tokens, seen = [], 0, set()
        for span, digest, tensors, chunk in zip(plan.spans, plan.hashes, plan.stored, span_chunks):
            if tensors is not None or digest in seen or fusion.fresh_kv is None:
                continue
            seen.add(digest)
            keys, values = fusion.fresh_chunk_kv(chunk)
            blob = self.engine.stored_chunk(fusion.layout.token_ids[span.start : span.end].tolist(), keys, values)
            items.append((chunk_key(self.engine, digest), blob, None))
            tokens += len(span)
        if items:
            self.store.put_many(items)  # a cache fill: a store that cannot take it drops it
        return tokens


def _holds(tensors: dict | None, token_ids: list[int], span: Span) -> bool:
    """Whether stored tensors are this span's (the key is a hash: the ids are compared)."""
    if tensors is None:
        return False
    stored = tensors.get("tokens")
    if stored is None or stored.numel() != len(span):
        log.warning("a stored span's tokens do not match its key: recomputed")
        return False
    return stored.tolist() == token_ids[span.start : span.end]
