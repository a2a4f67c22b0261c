"""ragkv chunk store: content-addressed, checksummed KV tensor blobs.

A leaf package: it knows keys, bytes and tensors, never a model.  Start with
:func:`open_store` and the :class:`ChunkStore` contract.

Names are imported on first use (PEP 562), so `ragkv.store.errors` alone, which the
ingestion checks need before any model or tensor code, does not import torch.
"""

from importlib import import_module

_WHERE = {
    "ChunkEntry": "base",
    "ChunkStore": "base",
    "decode_blob": "blob",
    "encode_blob": "blob",
    "CorruptBlobError": "errors",
    "StoreError": "errors",
    "StoreUnavailableError": "errors",
    "ChunkKey": "keys",
    "hash_tokens": "keys",
    "key_prefix": "keys",
    "LMDBEnvironment": "lmdb_env",
    "LMDBStore": "lmdb_store",
    "ByteLRU": "lru",
    "RedisStore": "redis_store",
    "LRUStats": "stats",
    "StoreStats": "stats",
    "TieredStore": "tiered",
    "open_store": "url",
}

__all__ = sorted(_WHERE)


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module 'ragkv.store' has no attribute {name!r}")
    return getattr(import_module(f"ragkv.store.{_WHERE[name]}"), name)
