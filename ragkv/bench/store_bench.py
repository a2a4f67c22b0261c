"""Throughput benchmark for chunk stores against a plain-file baseline.

Writes ``chunks`` KV blobs of a given model geometry through each store, reads
them back twice ("cold": the first read after writing; "warm": again, with
whatever the store and OS page cache kept), and does the same with one file
per blob and ``open().read()``.  The file baseline shows the I/O ceiling; the
gap to a store is its encode/verify/transaction cost.

Store figures include encoding (``put``) and checksum verification plus
decoding (``get``), and LMDB commits are fsync'ed; the file baseline moves the
same encoded bytes only, without fsync.  MB/s is 10^6 bytes of encoded blob
per second.  Returns plain, JSON-ready dicts;
printing is the CLI's job.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Callable, Mapping
from pathlib import Path

import torch

from ragkv.store.base import ChunkStore
from ragkv.store.blob import encode_blob
from ragkv.store.keys import ChunkKey, hash_tokens

RAW_FILE = "raw_file"
_DROP_CACHES = "/proc/sys/vm/drop_caches"
_DISTINCT_PAYLOADS = 8  # random tensor sets cycled over the keys; bounds benchmark memory


def run_store_bench(
    stores: Mapping[str, ChunkStore],
    *,
    chunks: int,
    tokens_per_chunk: int,
    layers: int,
    kv_heads: int,
    head_dim: int,
    dtype: torch.dtype = torch.float16,
    tmp_dir: str | os.PathLike[str],
    batch_size: int = 16,
    drop_page_cache: bool = False,
    seed: int = 0,
) -> dict[str, object]:
    """Benchmark ``stores`` (name -> store) plus the ``raw_file`` baseline.

    Each chunk is ``{"keys", "values"}`` tensors of shape
    ``[layers, kv_heads, tokens_per_chunk, head_dim]``.  Keys are unique to
    the run and deleted afterwards.  ``drop_page_cache`` drops the OS page
    cache before each cold read when ``/proc/sys/vm/drop_caches`` is writable
    (root); it affects the whole machine, so it is off by default.
    """
    for name, value in (
        ("chunks", chunks),
        ("tokens_per_chunk", tokens_per_chunk),
        ("layers", layers),
        ("kv_heads", kv_heads),
        ("head_dim", head_dim),
        ("batch_size", batch_size),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int; got {value!r}")
    if RAW_FILE in stores:
        raise ValueError(f"{RAW_FILE!r} is reserved for the plain-file baseline")
    for name, store in stores.items():
        if not isinstance(store, ChunkStore):
            raise TypeError(f"stores[{name!r}] is a {type(store).__name__}, not a ChunkStore")

    generator = torch.Generator().manual_seed(seed)
    shape = (layers, kv_heads, tokens_per_chunk, head_dim)
    payloads = [
        {name: torch.randn(shape, generator=generator).to(dtype) for name in ("keys", "values")}
        for _ in range(min(chunks, _DISTINCT_PAYLOADS))
    ]
    run_id = os.urandom(6).hex()
    keys = [ChunkKey(f"bench-{run_id}", hash_tokens([seed, i]), 1) for i in range(chunks)]
    blobs = [encode_blob(payload) for payload in payloads]
    total_bytes = sum(len(blobs[i % len(blobs)]) for i in range(chunks))
    kv_bytes_per_token = 2 * layers * kv_heads * head_dim * dtype.itemsize
    can_drop = os.access(_DROP_CACHES, os.W_OK)
    drop = drop_page_cache and can_drop

    results: dict[str, dict[str, object]] = {}
    for name, store in stores.items():
        results[name] = _bench_store(store, keys, payloads, batch_size, total_bytes, drop)
    results[RAW_FILE] = _bench_files(tmp_dir, blobs, chunks, total_bytes, drop)
    return {
        "geometry": {
            "chunks": chunks,
            "tokens_per_chunk": tokens_per_chunk,
            "layers": layers,
            "kv_heads": kv_heads,
            "head_dim": head_dim,
            "dtype": str(dtype).removeprefix("torch."),
            "batch_size": batch_size,
        },
        "kv_bytes_per_token": kv_bytes_per_token,
        "kv_bytes_per_chunk": kv_bytes_per_token * tokens_per_chunk,
        "blob_bytes_per_chunk": round(total_bytes / chunks),
        "page_cache_dropped": drop,
        "drop_caches_writable": can_drop,
        "backends": results,
    }


def _rates(prefix: str, seconds: float, total_bytes: int, chunks: int) -> dict[str, float]:
    seconds = max(seconds, 1e-9)
    return {
        f"{prefix}_mb_s": round(total_bytes / seconds / 1e6, 1),
        f"{prefix}_chunks_s": round(chunks / seconds, 1),
        f"{prefix}_s": round(seconds, 4),
    }


def _timed(fn: Callable[[], object]) -> tuple[float, object]:
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


def _drop_page_cache() -> None:
    os.sync()
    with open(_DROP_CACHES, "w") as handle:
        handle.write("1\n")


def _bench_store(
    store: ChunkStore,
    keys: list[ChunkKey],
    payloads: list[dict[str, torch.Tensor]],
    batch_size: int,
    total_bytes: int,
    drop: bool,
) -> dict[str, object]:
    batches = [list(range(i, min(i + batch_size, len(keys)))) for i in range(0, len(keys), batch_size)]

    def write() -> None:
        for batch in batches:
            store.put_many([(keys[i], payloads[i % len(payloads)]) for i in batch])

    def read() -> int:
        misses = 0
        for batch in batches:
            misses += sum(got is None for got in store.get_many([keys[i] for i in batch]))
        return misses

    try:
        write_s, _ = _timed(write)
        if drop:
            _drop_page_cache()
        cold_s, cold_misses = _timed(read)
        warm_s, warm_misses = _timed(read)
        first = store.get(keys[0])
        verified = first is not None and all(
            torch.equal(first[name].view(torch.uint8), payloads[0][name].view(torch.uint8)) for name in payloads[0]
        )
    finally:
        for key in keys:
            store.delete(key)
    return {
        **_rates("write", write_s, total_bytes, len(keys)),
        **_rates("read_cold", cold_s, total_bytes, len(keys)),
        **_rates("read_warm", warm_s, total_bytes, len(keys)),
        "misses": cold_misses + warm_misses,
        "verified": verified,
    }


def _bench_files(
    tmp_dir: str | os.PathLike[str],
    blobs: list[bytes],
    chunks: int,
    total_bytes: int,
    drop: bool,
) -> dict[str, object]:
    folder = Path(tempfile.mkdtemp(prefix="raw_file_bench_", dir=tmp_dir))
    paths = [folder / f"{i}.safetensors" for i in range(chunks)]

    def write() -> None:
        for i, path in enumerate(paths):
            with open(path, "wb") as handle:
                handle.write(blobs[i % len(blobs)])

    def read() -> int:
        size = 0
        for path in paths:
            with open(path, "rb") as handle:
                size += len(handle.read())
        return size

    try:
        write_s, _ = _timed(write)
        if drop:
            _drop_page_cache()
        cold_s, cold_size = _timed(read)
        warm_s, _ = _timed(read)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return {
        **_rates("write", write_s, total_bytes, chunks),
        **_rates("read_cold", cold_s, total_bytes, chunks),
        **_rates("read_warm", warm_s, total_bytes, chunks),
        "misses": 0,
        "verified": cold_size == total_bytes,
        "fsync": False,
    }
