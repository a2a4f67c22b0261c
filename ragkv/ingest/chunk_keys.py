"""The one place chunk keys are made: ingested chunks, passages pasted into prompts and the
anchors that find a passage's rows inside a stored one all live in one key space.

    ChunkKey(engine fingerprint, hash(tenant salt, token ids), KV format version, tenant)

The tenant salt keeps one tenant's rows out of another's reach (unless the server shares
chunks across tenants), and the key names its tenant too, so the store can count and bound
each tenant's bytes (a shared chunk names none); the fingerprint keeps another model's rows
out.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ragkv.engine.fingerprint import KV_FORMAT_VERSION
from ragkv.store.keys import ChunkKey, hash_tokens

ANCHOR_SALT = "anchor/"
"""Anchor keys hash a short window of tokens: salted apart from chunk keys, so a window can
never be read as a chunk of the same tokens."""


@dataclass(frozen=True)
class ChunkKeys:
    """Keys of one engine's chunk KV."""

    fingerprint: str
    share_across_tenants: bool = False

    @classmethod
    def of(cls, engine, share_across_tenants: bool = False) -> ChunkKeys:
        return cls(engine.fingerprint, share_across_tenants)

    def namespace(self, tenant: str) -> str:
        return "" if self.share_across_tenants else tenant

    def digest(self, tenant: str, token_ids: Sequence[int]) -> str:
        """The content hash of token ids under the tenant's salt."""
        return hash_tokens(token_ids, self.namespace(tenant))

    def key(self, tenant: str, digest: str) -> ChunkKey:
        """The key of the tenant's chunk whose content hash is `digest` (see `digest`)."""
        return ChunkKey(self.fingerprint, digest, KV_FORMAT_VERSION, self.namespace(tenant))

    def of_tokens(self, tenant: str, token_ids: Sequence[int]) -> ChunkKey:
        return self.key(tenant, self.digest(tenant, token_ids))

    def anchor(self, tenant: str, window: Sequence[int]) -> ChunkKey:
        """Where the record of an anchor window (which stored run holds it, and where) lives."""
        return self.key(tenant, hash_tokens(window, ANCHOR_SALT + self.namespace(tenant)))
