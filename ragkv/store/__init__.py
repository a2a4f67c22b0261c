"""ragkv chunk store: content-addressed, checksummed KV tensor blobs.

A leaf package: it knows keys, bytes and tensors, never a model.  Start with
:func:`open_store` and the :class:`ChunkStore` contract.
"""

from ragkv.store.base import ChunkEntry, ChunkStore
from ragkv.store.blob import decode_blob, encode_blob
from ragkv.store.errors import CorruptBlobError, StoreError, StoreUnavailableError
from ragkv.store.keys import ChunkKey, hash_tokens, key_prefix
from ragkv.store.lmdb_env import LMDBEnvironment
from ragkv.store.lmdb_store import LMDBStore
from ragkv.store.lru import ByteLRU
from ragkv.store.redis_store import RedisStore
from ragkv.store.stats import LRUStats, StoreStats
from ragkv.store.tiered import TieredStore
from ragkv.store.url import open_store

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
