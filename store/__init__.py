"""ragkv chunk store: content-addressed, checksummed KV tensor blobs.

A leaf package: it knows keys, bytes and tensors, never a model.  Start with
:func:`open_store` and the :class:`ChunkStore` contract.
"""

from store.base import ChunkEntry, ChunkStore
from store.blob import decode_blob, encode_blob
from store.errors import CorruptBlobError, StoreError, StoreUnavailableError
from store.keys import ChunkKey, hash_tokens, key_prefix
from store.lmdb_env import LMDBEnvironment
from store.lmdb_store import LMDBStore
from store.lru import ByteLRU
from store.redis_store import RedisStore
from store.stats import LRUStats, StoreStats
from store.tiered import TieredStore
from store.url import open_store

__all__ = [
    "ByteLRU",
    "ChunkEntry",
    "ChunkKey",
    "ChunkStore",
    "CorruptBlobError",
    "LMDBEnvironment",
    "LMDBStore",
    "LRUStats",
    "RedisStore",
    "StoreError",
    "StoreStats",
    "StoreUnavailableError",
    "TieredStore",
    "decode_blob",
    "encode_blob",
    "hash_tokens",
    "key_prefix",
    "open_store",
]
