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

from ragkv.app.chat.contexts import Context, Insertion
from ragkv.engine.kv_cache import KVCache, WindowRows
from ragkv.engine.kv_storage import KVStorageFormat
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
    return KVStorageFormat("int8", bits=8, key_group=128, value_group=64 if head_dim % 64 == 0 else head_dim)


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
            for name, x, grouping, group in (
                ("keys", k, "tokens", codes.key_group),
                ("values", v, "channels", codes.value_group),
            ):
                for part, tensor in zip(("codes", "scale", "minimum"), _quantize(x, grouping, group), strict=True):
                    tensors[f"{prefix}{name}.{part}"] = tensor
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


_LEVELS = 255
_SCALE_FLOOR = 2.0**-20  # as kv_quant: a constant group keeps a non-zero scale, exact in float16


def _blocks(x: torch.Tensor, grouping: str, group: int) -> torch.Tensor:
    """One layer's [H, T, D] as groups along dim 2 (tokens: [H, T/group, group, D], the
    tokens a multiple of `group`) or dim 3 (channels: [H, T, D/group, group])."""
    heads, tokens, dim = x.shape
    if grouping == "tokens":
        return x.reshape(heads, tokens // group, group, dim)
    return x.reshape(heads, tokens, dim // group, group)


def _quantize(x: torch.Tensor, grouping: str, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """8-bit codes of x [L, H, T, D] in kv_quant's layout and grid (scale and minimum rounded
    to float16 before the codes are chosen), a layer at a time so the float32 temporaries stay
    small: keys per channel over `group`-token runs (the last run shorter), values per token
    over `group` channels."""
    layers, heads, tokens, dim = x.shape
    codes = torch.empty(x.shape, dtype=torch.uint8)
    runs = -(-tokens // group) if grouping == "tokens" else tokens
    width = dim if grouping == "tokens" else dim // group
    scale = torch.empty((layers, heads, runs, width), dtype=torch.float16)
    minimum = torch.empty_like(scale)
    spans = [(0, tokens)]
    if grouping == "tokens":
        whole = tokens // group * group
        spans = [span for span in ((0, whole), (whole, tokens)) if span[1] > span[0]]
    for layer in range(layers):
        for start, end in spans:
            size = min(group, end - start) if grouping == "tokens" else group
            blocks = _blocks(x[layer, :, start:end].float(), grouping, size)
            axis = 2 if grouping == "tokens" else 3
            low = blocks.amin(axis, keepdim=True).half().float()
            step = ((blocks.amax(axis, keepdim=True) - low) / _LEVELS).clamp_min(_SCALE_FLOOR).half().float()
            codes[layer, :, start:end] = (
                ((blocks - low) / step).round_().clamp_(0, _LEVELS).to(torch.uint8).reshape(heads, end - start, dim)
            )
            first = start // group if grouping == "tokens" else 0
            rows = slice(first, first + blocks.shape[1])
            scale[layer, :, rows] = step.squeeze(axis).half()
            minimum[layer, :, rows] = low.squeeze(axis).half()
    return codes, scale, minimum


def _dequantize(
    codes: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor, grouping: str, group: int, dtype: torch.dtype
) -> torch.Tensor:
    """x [L, H, T, D] in `dtype` from `_quantize`'s codes, a layer at a time."""
    layers, heads, tokens, dim = codes.shape
    expected = (
        (layers, heads, -(-tokens // group), dim) if grouping == "tokens" else (layers, heads, tokens, dim // group)
    )
    if tuple(scale.shape) != expected or tuple(minimum.shape) != expected or codes.dtype != torch.uint8:
        raise ValueError("int8 codes disagree with their scales")
    out = torch.empty(codes.shape, dtype=dtype)
    whole = tokens // group * group if grouping == "tokens" else tokens
    for layer in range(layers):
        if grouping == "tokens":  # full runs broadcast their row of scales; a shorter last run its own
            step, low = scale[layer].float().unsqueeze(2), minimum[layer].float().unsqueeze(2)
            runs = whole // group
            if runs:
                blocks = codes[layer, :, :whole].reshape(heads, runs, group, dim).float()
                decoded = torch.addcmul(low[:, :runs], blocks, step[:, :runs])
                out[layer, :, :whole] = decoded.reshape(heads, whole, dim)
            if whole < tokens:
                rest = codes[layer, :, whole:].float().unsqueeze(1)
                decoded = torch.addcmul(low[:, runs:], rest, step[:, runs:])
                out[layer, :, whole:] = decoded.squeeze(1)
        else:
            step, low = scale[layer].float().unsqueeze(3), minimum[layer].float().unsqueeze(3)
            blocks = codes[layer].float().reshape(heads, tokens, dim // group, group)
            out[layer] = torch.addcmul(low, blocks, step).reshape(heads, tokens, dim)
    return out


def _kv(tensors: dict[str, torch.Tensor], prefix: str, codes: KVStorageFormat | None, dtype: torch.dtype):
    if codes is None:
        return tensors[prefix + "keys"].to(dtype), tensors[prefix + "values"].to(dtype)
    kv = []
    for name, grouping, group in (("keys", "tokens", codes.key_group), ("values", "channels", codes.value_group)):
        parts = [tensors[f"{prefix}{name}.{part}"] for part in ("codes", "scale", "minimum")]
        kv.append(_dequantize(*parts, grouping, group, dtype))
    return tuple(kv)


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
