"""A chat context as one blob (store.blob: safetensors with a CRC-32, or a MAC keyed by the
deployment secret; never pickle): its KV rows, the token ids of the conversation and of
every row, and a JSON record of the rest. What Redis holds for sessions and for the
anonymous contexts other replicas may continue.

The KV may be stored narrower than the cache holds it (`kv_dtype`, e.g. float16 for a
float32 cache) and comes back in the cache's own dtype; a 16-bit cache is stored as it is,
bit for bit.
"""

from __future__ import annotations

import json

import torch

from ragkv.app.contexts import Context, Insertion
from ragkv.engine.kv_cache import KVCache, WindowRows
from ragkv.store.blob import decode_blob, encode_blob
from ragkv.store.errors import CorruptBlobError

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def context_meta(context: Context) -> dict:
    return {
        "id": context.id,
        "tenant": context.tenant,
        "fingerprint": context.fingerprint,
        "insertions": [[i.at, i.rows, list(i.chunk_hashes)] for i in context.insertions],
        "turns": context.turns,
        "created": context.created,
        "updated": context.updated,
        "version": context.version,
        "length": context.length,
        "explicit": context.explicit,
        "dtype": str(context.cache.dtype).removeprefix("torch."),
    }


def compact_dtype(dtype: torch.dtype) -> torch.dtype:
    """What a context's KV travels as: a 16-bit cache as it is, a wider one as float16."""
    return dtype if dtype in (torch.float16, torch.bfloat16) else torch.float16


def encode_context(context: Context, *, kv_dtype: torch.dtype | None = None, mac_key: bytes | None = None) -> bytes:
    keys, values, window = context.cache.parts()
    tensors = {
        "keys": keys,
        "values": values,
        "conversation": torch.tensor(context.conversation_ids, dtype=torch.int32),
        "rows": torch.tensor(context.row_ids, dtype=torch.int32),
    }
    meta = context_meta(context)
    if window is not None:  # the sliding-window layers hold only their last rows
        tensors["window.keys"], tensors["window.values"] = window.keys, window.values
        meta["window"] = {"layers": list(window.layers), "window": window.window, "start": window.start}
    if kv_dtype is not None:
        tensors.update({name: tensors[name].to(kv_dtype) for name in tensors if "keys" in name or "values" in name})
    return encode_blob(tensors, {"session": json.dumps(meta)}, mac_key=mac_key)


def decode_context(blob: bytes | bytearray | memoryview, *, mac_key: bytes | None = None) -> Context:
    """Raises CorruptBlobError for anything that is not a valid context blob (or not signed
    with `mac_key`)."""
    tensors, metadata = decode_blob(blob, mac_key=mac_key)
    try:
        meta = json.loads(metadata["session"])
        keys, values = tensors["keys"], tensors["values"]
        conversation, rows = tensors["conversation"].tolist(), tensors["rows"].tolist()
        insertions = [Insertion(at, count, tuple(hashes)) for at, count, hashes in meta["insertions"]]
        dtype = _DTYPES[meta.get("dtype", str(keys.dtype).removeprefix("torch."))]
        window = None
        if "window" in meta:
            held = meta["window"]
            window = WindowRows(
                tuple(held["layers"]),
                held["window"],
                tensors["window.keys"].to(dtype),
                tensors["window.values"].to(dtype),
                held["start"],
            )
    except (KeyError, ValueError, TypeError) as error:
        raise CorruptBlobError(f"not a context blob: {error}") from error
    length = keys.shape[2]
    if values.shape != keys.shape or len(rows) != length or meta.get("length") != length:
        raise CorruptBlobError("context blob tensors disagree with its metadata")
    if window is not None and (
        window.values.shape != window.keys.shape or window.keys.shape[2] != length - window.start
    ):
        raise CorruptBlobError("context blob window rows disagree with its metadata")
    try:
        cache = KVCache.from_parts(keys.to(dtype), values.to(dtype), length, length, window)
    except ValueError as error:
        raise CorruptBlobError(f"not a context blob: {error}") from error
    return Context(
        meta["id"],
        meta["tenant"],
        meta["fingerprint"],
        conversation,
        rows,
        cache,
        insertions,
        explicit=meta.get("explicit", True),
        turns=meta["turns"],
        created=meta["created"],
        updated=meta["updated"],
        version=meta["version"],
    )
