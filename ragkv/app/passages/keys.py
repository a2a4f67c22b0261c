"""Where the passage spans of a prompt are and their chunk keys: the span finder and the key
space together. Needs no model, only the tokenizer and the engine's fingerprint: the vLLM
connector's scheduler side asks the store with these keys which spans it holds before any
worker loads them."""

from __future__ import annotations

from dataclasses import dataclass

from ragkv.app.passages.finder import Span, SpanConfig, SpanFinder
from ragkv.ingest.chunk_keys import ChunkKeys
from ragkv.store.keys import ChunkKey


@dataclass(frozen=True)
class FoundSpans:
    spans: list[Span]
    digests: list[str]
    keys: list[ChunkKey]


class SpanKeys:
    def __init__(
        self, tokenizer, fingerprint: str, config: SpanConfig = SpanConfig(), share_across_tenants: bool = False
    ):
        self.finder = SpanFinder(tokenizer, config)
        self.chunk_keys = ChunkKeys(fingerprint, share_across_tenants)

    def find(self, tenant: str, token_ids: list[int], start: int) -> FoundSpans:
        """The spans in token_ids[start:] and their keys under the tenant's salt."""
        # a span needs a prefix before it (the template's opening at least) to be fused into
        spans = [span for span in self.finder.spans(token_ids, start) if span.start > 0]
        digests = [self.chunk_keys.digest(tenant, token_ids[span.start : span.end]) for span in spans]
        return FoundSpans(spans, digests, [self.chunk_keys.key(tenant, d) for d in digests])
