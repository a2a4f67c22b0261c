"""A chat context as one blob (store.blob: safetensors with a CRC-32, or a MAC keyed by the
deployment secret; never pickle): its KV rows, the token ids of the conversation and of
every row, and a JSON record of the rest. What Redis holds for sessions and for the
anonymous contexts other replicas may continue.

The KV may be stored narrower than the cache holds it and comes back in the cache's own
dtype: `kv_dtype` (e.g. float16 for a float32 cache; a 16-bit cache is stored as it is, bit
for bit), or `kv_codes="int8"`, 8-bit codes as chunk blobs can hold them (keys per channel
over 128-token groups, values per token over 64-channel groups, a float16 scale and minimum
per group: about half the bytes of 16 bits). The codes' descriptor is in the blob's record.

`context_tensors` (the copy, on the turn's thread) and `encode_context_tensors` (the bytes,
on any thread, no torch compute) split `encode_context` for the publisher of shared contexts.
"""

from __future__ import annotations

import json

import torch

from ragkv.app.contexts import Context, Insertion
from ragkv.engine.kv_cache import KVCache, WindowRows
from ragkv.engine.kv_storage import KVStorageFormat, dense
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


KV_CODES = ("16bit", "int8")
"""How a published context's KV travels: the cache's 16-bit dtype (float16 for a wider
cache), or 8-bit codes."""


def _int8(head_dim: int) -> KVStorageFormat:
    return KVStorageFormat("int8", bits=8, key_group=128, value_group=min(64, head_dim))


def _format_of(descriptor: str) -> KVStorageFormat:
    """The 8-bit format a blob's record names ("int8:k128:v64")."""
    name, keys, values = descriptor.split(":")
    if name != "int8" or not keys.startswith("k") or not values.startswith("v"):
        raise ValueError(f"unknown KV codes {descriptor!r}")
    return KVStorageFormat("int8", bits=8, key_group=int(keys[1:]), value_group=int(values[1:]))


def context_tensors(
    context: Context, *, kv_dtype: torch.dtype | None = None, kv_codes: str | None = None
) -> tuple[dict[str, torch.Tensor], dict]:
    """The blob's tensors (copies: the context may change after) and record."""
    keys, values, window = context.cache.parts()
    meta = context_meta(context)
    kv = {"": (keys, values)}
    if window is not None:  # the sliding-window layers hold only their last rows
        kv["window."] = (window.keys, window.values)
        meta["window"] = {"layers": list(window.layers), "window": window.window, "start": window.start}
    tensors = {
        "conversation": torch.tensor(context.conversation_ids, dtype=torch.int32),
        "rows": torch.tensor(context.row_ids, dtype=torch.int32),
    }
    if kv_codes == "int8":
        codes = _int8(keys.shape[3])
        meta["kv_codes"] = codes.descriptor
        for prefix, (k, v) in kv.items():
            tensors.update({prefix + name: t for name, t in codes.pack(k, v).items()})
        return tensors, meta
    if kv_codes not in (None, "16bit"):
        raise ValueError(f"kv_codes must be one of {KV_CODES}, got {kv_codes!r}")
    for prefix, (k, v) in kv.items():
        dtype = kv_dtype or k.dtype
        tensors[prefix + "keys"] = k.to(dtype, copy=True).contiguous()
        tensors[prefix + "values"] = v.to(dtype, copy=True).contiguous()
    return tensors, meta


def encode_context_tensors(tensors: dict[str, torch.Tensor], meta: dict, *, mac_key: bytes | None = None) -> bytes:
    return encode_blob(tensors, {"session": json.dumps(meta)}, mac_key=mac_key)


def encode_context(
    context: Context,
    *,
    kv_dtype: torch.dtype | None = None,
    kv_codes: str | None = None,
    mac_key: bytes | None = None,
) -> bytes:
    tensors, meta = context_tensors(context, kv_dtype=kv_dtype, kv_codes=kv_codes)
    return encode_context_tensors(tensors, meta, mac_key=mac_key)


def _kv(tensors: dict[str, torch.Tensor], prefix: str, codes: KVStorageFormat | None, dtype: torch.dtype):
    if codes is None:
        return tensors[prefix + "keys"].to(dtype), tensors[prefix + "values"].to(dtype)
    packed = {name.removeprefix(prefix): t for name, t in tensors.items() if name.startswith(prefix)}
    keys, values = codes.unpack(packed)
    return dense(keys, dtype), dense(values, dtype)


def decode_context(blob: bytes | bytearray | memoryview, *, mac_key: bytes | None = None) -> Context:
    """Raises CorruptBlobError for anything that is not a valid context blob (or not signed
    with `mac_key`)."""
    tensors, metadata = decode_blob(blob, mac_key=mac_key)
    try:
        meta = json.loads(metadata["session"])
        codes = _format_of(meta["kv_codes"]) if "kv_codes" in meta else None
        dtype = _DTYPES[meta.get("dtype", "float16" if codes else str(tensors["keys"].dtype).removeprefix("torch."))]
        keys, values = _kv(tensors, "", codes, dtype)
        conversation, rows = tensors["conversation"].tolist(), tensors["rows"].tolist()
        insertions = [Insertion(at, count, tuple(hashes)) for at, count, hashes in meta["insertions"]]
        window = None
        if "window" in meta:
            held = meta["window"]
            window_keys, window_values = _kv(tensors, "window.", codes, dtype)
            window = WindowRows(tuple(held["layers"]), held["window"], window_keys, window_values, held["start"])
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
        cache = KVCache.from_parts(keys, values, length, length, window)
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
