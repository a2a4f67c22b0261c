"""What the connector decides and computes, without vLLM: the scheduler side's plan for a
prompt (how many tokens ragkv provides, and how) and the worker side's rows.

    scheduler  prompt ids ─► the whole prompt stored (vLLM's own KV, saved earlier)?   "prefix"
                          └► else SpanKeys: passage spans ─► store.contains per key
                             stored spans >= min_reused_share of the prompt?          "fuse"
                             else vLLM computes it; its new spans are saved           "none"
    worker     "prefix" ─► the stored rows, exactly as vLLM computed them
               "fuse"   ─► PromptPassages.prepare_prompt, as the server's chat turns and
                           completions: plan, prefill before the first span, fuse with the
                           strategy (new spans are computed in place and put in the store)
                           ─► the fused cache's post-RoPE rows
               save     ─► vLLM's rows read back: the whole prompt (a prefix blob), and each new
                           span's keys un-rotated to pre-RoPE and stored as the server stores a
                           span (PromptPassages.stored_run: its chunk key, blob and anchors)

In every mode vLLM computes the prompt's last token itself (it needs one row to compute),
reading the rows ragkv wrote.
"""

from __future__ import annotations

import hashlib
import logging
import time
from dataclasses import dataclass

import torch

from ragkv.app.passages import PromptPassages, SpanKeys
from ragkv.engine.fingerprint import KV_FORMAT_VERSION
from ragkv.fusion import build_strategy
from ragkv.kernels.rope import apply_rope
from ragkv.store.base import ChunkStore
from ragkv.store.keys import ChunkKey, hash_tokens
from ragkv.vllm.config import ConnectorConfig

log = logging.getLogger("ragkv.vllm")

PREFIX, FUSE, NONE = "prefix", "fuse", "none"


def prefix_fingerprint(chunk_fingerprint: str, vllm_dtype: str) -> str:
    """Key space of whole-prompt blobs: vLLM's own KV, so vLLM's dtype is part of it."""
    payload = f"vllm-prefix/{chunk_fingerprint}/{vllm_dtype}".encode()
    return hashlib.blake2b(payload, digest_size=12).hexdigest()


@dataclass(frozen=True)
class Decision:
    mode: str
    tokens: int
    """Tokens ragkv provides beyond vLLM's own prefix-cache hit."""
    reused: int = 0
    """Tokens of stored spans (fuse)."""


class Planner:
    """The scheduler side: what a prompt's stored data covers."""

    def __init__(self, config: ConnectorConfig, keys: SpanKeys, store: ChunkStore, prefix_space: str):
        self.config, self.keys, self.store, self.prefix_space = config, keys, store, prefix_space

    def prefix_key(self, token_ids: list[int]) -> ChunkKey:
        """The key of a prompt's rows but its last (what a repeat of it loads)."""
        namespace = self.keys.chunk_keys.namespace(self.config.tenant)
        digest = hash_tokens(token_ids[:-1], f"prefix/{namespace}")
        return ChunkKey(self.prefix_space, digest, KV_FORMAT_VERSION, namespace)

    def decide(self, token_ids: list[int], computed: int) -> Decision:
        provided = len(token_ids) - 1
        if provided <= computed:
            return Decision(NONE, 0)
        if provided >= self.config.min_prefix_tokens and self.store.contains(self.prefix_key(token_ids)):
            return Decision(PREFIX, provided - computed)
        found = self.keys.find(self.config.tenant, token_ids, 0)
        reused = sum(len(span) for span, key in zip(found.spans, found.keys) if self.store.contains(key))
        if reused and reused >= self.config.min_reused_share * len(token_ids):
            return Decision(FUSE, provided - computed, reused)
        return Decision(NONE, 0, reused)


def _unrotate(model, keys: torch.Tensor, start: int) -> torch.Tensor:
    """Pre-RoPE keys [layers, H, T, D] of post-RoPE ones at positions start.. (each layer
    run with its own RoPE; attention scaling folded into cos/sin is divided out)."""
    out = torch.empty(keys.shape, dtype=torch.float32)
    positions = torch.arange(start, start + keys.shape[2])
    for run, rotary in model.rope_runs():
        cos, sin = rotary.cos_sin(positions)
        cos, sin = cos.float(), sin.float()
        scale = rotary.attention_scaling**2
        for layer in range(run.start, run.stop):
            unrotated = apply_rope(keys[layer].float(), cos, -sin)
            out[layer] = unrotated / scale if scale != 1.0 else unrotated
    return out


class Rows:
    """The worker side: the rows a prompt's plan provides, and what is saved of a prompt."""

    def __init__(self, config: ConnectorConfig, engine, store: ChunkStore, planner: Planner):
        self.config, self.engine, self.store, self.planner = config, engine, store, planner
        self.passages = PromptPassages(engine, store, share_across_tenants=config.share_across_tenants)
        self.strategies = {config.strategy: build_strategy(config.strategy)}

    def prefix_rows(self, token_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The stored rows [layers, H, len - 1, D] of this exact prompt, or None (gone)."""
        tensors = self.store.get(self.planner.prefix_key(token_ids))
        if tensors is None or tensors["tokens"].tolist() != token_ids[:-1]:
            return None
        return tensors["keys"], tensors["values"]

    def fused_rows(self, token_ids: list[int], strategy: str | None = None) -> tuple[torch.Tensor, torch.Tensor, dict]:
        """Post-RoPE rows [layers, H, len, D] of the prompt fused from its stored spans
        (new spans computed in place and stored) with `strategy` (None: the config's), and
        what the fusion did."""
        started = time.perf_counter()
        spec = strategy or self.config.strategy
        if spec not in self.strategies:
            self.strategies[spec] = build_strategy(spec)
        fused = self.passages.prepare_prompt(self.config.tenant, token_ids, self.strategies[spec], 0)
        if fused is None:  # the spans the scheduler saw are no longer there: a plain prefill
            cache, _ = self.engine.prefill(token_ids)
            return cache.keys[:, :, : len(token_ids)], cache.values[:, :, : len(token_ids)], {"hits": 0}
        plan, cache = fused.plan, fused.cache
        info = {
            "strategy": spec,
            "hits": plan.hits,
            "misses": plan.misses,
            "reused_tokens": plan.reused_tokens,
            "recomputed_tokens": fused.fusion.recomputed_tokens,
            "seconds": round(time.perf_counter() - started, 4),
            "timings": {name: round(value, 4) for name, value in fused.fusion.timings.items()},
        }
        return cache.keys[:, :, : len(token_ids)], cache.values[:, :, : len(token_ids)], info

    def save(self, token_ids: list[int], keys: torch.Tensor, values: torch.Tensor, whole: bool) -> dict:
        """Store what vLLM computed for a prompt: post-RoPE rows [layers, H, len - 1, D].
        `whole`: the rows are vLLM's own for the whole prompt (not fused), so the prompt
        may be kept as a prefix blob."""
        items, saved = [], {"prefix": 0, "spans": 0}
        if whole and self.config.save_prefix and keys.shape[2] >= self.config.min_prefix_tokens:
            key = self.planner.prefix_key(token_ids)
            if not self.store.contains(key):
                tensors = {
                    "keys": keys.contiguous(),
                    "values": values.contiguous(),
                    "tokens": torch.tensor(token_ids[:-1], dtype=torch.int32),
                }
                items.append((key, tensors, None))
                saved["prefix"] = keys.shape[2]
        if whole and self.config.save_spans:
            tenant = self.config.tenant
            found = self.passages.keys.find(tenant, token_ids, 0)
            for span, digest, key in zip(found.spans, found.digests, found.keys):
                if span.end > keys.shape[2] or self.store.contains(key):
                    continue
                rows = slice(span.start, span.end)
                pre_rope = _unrotate(self.engine.model, keys[:, :, rows], span.start)
                run = self.passages.stored_run(tenant, token_ids[rows], pre_rope, values[:, :, rows].float(), digest)
                items += [(run_key, blob, None) for run_key, blob in run]  # the server's keys and anchors
                saved["spans"] += 1
        if items:
            self.store.put_many(items)  # a cache fill: a store that cannot take it drops it
        return saved
