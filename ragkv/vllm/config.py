"""What `kv_connector_extra_config` may say, validated on construction.

Every field has ragkv's default. ragkv's engine takes vLLM's model dtype for its residual
stream and ragkv's own "auto" formats for prefill weights and the KV cache (bfloat16 on CPUs
with bf16 units, else the dtype), as `ragkv serve` and `ragkv ingest` do: a fused prompt is an
approximation whose error the fusion's selection sets, not the recompute's rounding, and
bfloat16 is what makes the recompute fast on such CPUs. The same defaults on both sides keep
ingestion and the connector in one key space (the chunk fingerprint includes the numerics).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any


@dataclass(frozen=True)
class ConnectorConfig:
    store_url: str | None = None
    """Chunk store URL (ragkv.store.url): lmdb://, redis://, redis+cluster://, tiered+lmdb://;
    None = the data folder's LMDB ($RAGKV_HOME, else ~/.ragkv), as everywhere in ragkv."""
    store_secret: str | None = field(default=None, repr=False)
    """The deployment secret ragkv's own servers and ingestion use (chunk blobs carry a MAC
    keyed by it); None = CRC-32 blobs."""
    strategy: str = "probe"
    """Fusion strategy spec for prompts with stored passages (ragkv.fusion.build_strategy)."""
    tenant: str = "default"
    """Tenant salt of the chunk keys (a span stored under one tenant is not found by another)."""
    share_across_tenants: bool = False
    min_reused_share: float = 0.3
    """Fuse only when stored spans hold at least this share of the prompt's tokens; below it
    vLLM computes the prompt and the connector stores its new spans."""
    save_prefix: bool = True
    """Keep vLLM's own KV of every prompt it computed in full (all tokens but the last), so the
    same prompt later (on any replica reading the store) loads it exactly."""
    min_prefix_tokens: int = 256
    """Prompts shorter than this are neither saved nor loaded as a whole prefix."""
    save_spans: bool = True
    """Store the passage spans of prompts vLLM computed in full (pre-RoPE, ragkv's format)."""
    engine: dict[str, Any] = field(default_factory=dict)
    """ragkv.engine.EngineConfig fields for ragkv's own copy of the model (model = vLLM's
    model folder and dtype = vLLM's dtype unless given; prefill_weights and kv_cache_dtype
    "auto" unless given: `{"prefill_weights": "float32", "kv_cache_dtype": "float32"}` makes
    a float32 recompute)."""

    def __post_init__(self) -> None:
        if not 0.0 <= self.min_reused_share <= 1.0:
            raise ValueError("min_reused_share must be in [0, 1]")
        if self.min_prefix_tokens < 1:
            raise ValueError("min_prefix_tokens must be >= 1")
        if not self.tenant:
            raise ValueError("tenant must not be empty")
        from ragkv.fusion import build_strategy

        build_strategy(self.strategy)

    @classmethod
    def from_extra(cls, extra: dict[str, Any] | None) -> ConnectorConfig:
        extra = dict(extra or {})
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(extra) - known)
        if unknown:
            raise ValueError(f"unknown kv_connector_extra_config keys {unknown}; known: {sorted(known)}")
        return cls(**extra)

    def engine_config(self, model: str, dtype: str):
        """The EngineConfig of ragkv's copy of vLLM's model."""
        from ragkv.engine.config import EngineConfig

        options = {"model": model, "dtype": dtype}
        options.update(self.engine)
        return EngineConfig(**options)
