"""`ragkv bench store`, per KV storage format: what a token costs, what loading costs, and
what the quantisation does to the first token and the answer.

Footprint and load: chunks of the model's geometry (random K/V; the bytes and the work do
not depend on the values) are written to a real LMDB store in each format, then read back
warm and placed into a runtime cache the way a query does (store read + checksum + decode,
then dequantise + RoPE into the cache rows). Times are per chunk: the median, and the
fastest (`best_*`), which is the steadier figure on a machine shared with other work.

Fidelity: for each example, every passage's chunk KV is computed once, stored-and-read in
each format (pack, blob, unpack) and fused with each strategy; the first-token logits and
the decoded answer are compared with the same strategy on float16 chunks.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from ragkv.app.generate import decode
from ragkv.bench.datasets import Example
from ragkv.bench.metrics import token_f1
from ragkv.engine import Engine
from ragkv.engine.generation import GenerationConfig
from ragkv.engine.kv_storage import KV_STORAGE_FORMATS, KVStorageFormat
from ragkv.engine.model_spec import ModelSpec
from ragkv.engine.rope import Rotary
from ragkv.fusion import FusionConfig, FusionInput, LoadedChunk
from ragkv.fusion.fidelity import next_token_kl
from ragkv.kernels.place_kv import place_keys, place_values
from ragkv.store.blob import decode_blob, encode_blob
from ragkv.store.keys import ChunkKey, hash_tokens
from ragkv.store.lmdb_store import LMDBStore

REFERENCE_FORMAT = "float16"


def run_format_load_bench(
    spec: ModelSpec,
    formats: list[str],
    *,
    chunks: int,
    tokens_per_chunk: int,
    tmp_dir: str | Path,
    repeats: int = 3,
    seed: int = 0,
) -> dict[str, dict[str, float]]:
    """Per format: blob bytes per token and per chunk, and ms per chunk to read and to place."""
    generator = torch.Generator().manual_seed(seed)
    shape = (spec.num_layers, spec.num_kv_heads, tokens_per_chunk, spec.head_dim)
    keys, values = torch.randn(shape, generator=generator), torch.randn(shape, generator=generator)
    tokens = torch.arange(tokens_per_chunk, dtype=torch.int32)
    rotary = Rotary(spec.rope)
    cos, sin = rotary.cos_sin(torch.arange(1000, 1000 + tokens_per_chunk))
    cache = torch.empty((2, *shape[:2], 2 * tokens_per_chunk, spec.head_dim))
    results = {}
    with tempfile.TemporaryDirectory(prefix="ragkv-formats-", dir=tmp_dir) as scratch:
        for name in formats:
            fmt = KV_STORAGE_FORMATS[name]
            tensors = {**fmt.pack(keys, values), "tokens": tokens}
            blob_bytes = len(encode_blob(tensors))
            store_keys = [ChunkKey(f"bench-{name}", hash_tokens([seed, i]), 1) for i in range(chunks)]
            with LMDBStore(Path(scratch, name)) as store:
                store.put_many([(key, tensors) for key in store_keys])
                store.get_many(store_keys)  # warm the page cache: the figure is the warm read
                read_s, place_s = [], []
                for key in store_keys * repeats:
                    started = time.perf_counter()
                    stored = store.get(key)
                    read = time.perf_counter()
                    stored_keys, stored_values = fmt.unpack(stored)
                    place_keys(cache[0, :, :, tokens_per_chunk:], stored_keys, cos, sin)
                    place_values(cache[1, :, :, tokens_per_chunk:], stored_values)
                    place_s.append(time.perf_counter() - read)
                    read_s.append(read - started)
            results[name] = {
                "descriptor": fmt.descriptor,
                "bytes_per_token": round(blob_bytes / tokens_per_chunk, 1),
                "kv_bytes_per_token": round(_kv_bytes(fmt.pack(keys, values)) / tokens_per_chunk, 1),
                "blob_bytes_per_chunk": blob_bytes,
                "read_ms_per_chunk": round(1e3 * statistics.median(read_s), 3),
                "place_ms_per_chunk": round(1e3 * statistics.median(place_s), 3),
                "load_ms_per_chunk": round(1e3 * statistics.median(r + p for r, p in zip(read_s, place_s)), 3),
                "best_read_ms_per_chunk": round(1e3 * min(read_s), 3),
                "best_place_ms_per_chunk": round(1e3 * min(place_s), 3),
                "best_load_ms_per_chunk": round(1e3 * min(r + p for r, p in zip(read_s, place_s)), 3),
            }
    return results


def run_format_fidelity_bench(
    engine: Engine,
    examples: list[Example],
    formats: list[str],
    strategies: list[tuple[str, FusionConfig]],
    *,
    max_new_tokens: int = 32,
    progress: Callable[[str], None] = lambda message: None,
) -> dict:
    """First-token KL, top-1 agreement and answer F1 of each format against float16 chunks."""
    tallies: dict[str, dict[str, dict[str, list[float]]]] = {
        label: {name: {"kl": [], "top1": [], "answer_f1": [], "bytes": [], "tokens": []} for name in formats}
        for label, _ in strategies
    }
    for number, example in enumerate(examples, start=1):
        progress(f"example {number}/{len(examples)}")
        raw = []
        for passage in example.passages:
            ids = engine.tokenize(passage)
            raw.append((ids, *engine.model.chunk_kv(torch.tensor(ids), engine.chunk_prefix_cache())))
        segments = engine.prompt.rag_segments(example.question)
        stored = {
            name: [_stored_chunk(KV_STORAGE_FORMATS[name], *chunk) for chunk in raw]
            for name in {REFERENCE_FORMAT, *formats}
        }
        for label, config in strategies:
            strategy = config.build()
            outcomes = {}
            for name in {REFERENCE_FORMAT, *formats}:
                fusion_input = FusionInput(
                    segments.prefix_ids,
                    [chunk for chunk, _ in stored[name]],
                    segments.question_ids,
                    len(engine.chunk_prefix_ids),
                    segments.question_text_span,
                )
                result = strategy.fuse(engine.model, fusion_input, engine.chunk_prefix_cache(), max_new_tokens)
                answer = decode(
                    engine, result.cache, result.logits, GenerationConfig(max_new_tokens=max_new_tokens)
                ).text.strip()
                outcomes[name] = (result.logits, answer)
            reference_logits, reference_answer = outcomes[REFERENCE_FORMAT]
            for name in formats:
                logits, answer = outcomes[name]
                tally = tallies[label][name]
                tally["kl"].append(next_token_kl(reference_logits, logits))
                tally["top1"].append(float(int(logits.argmax()) == int(reference_logits.argmax())))
                tally["answer_f1"].append(token_f1(answer, [reference_answer]))
                tally["bytes"].append(sum(nbytes for _, nbytes in stored[name]))
                tally["tokens"].append(sum(len(ids) for ids, _, _ in raw))
                progress(
                    f"example {number} {label} {name}: KL {tally['kl'][-1]:.5f} top1 {tally['top1'][-1]:.0f} "
                    f"answer F1 vs {REFERENCE_FORMAT} {tally['answer_f1'][-1]:.2f}"
                )
    return {
        "examples": len(examples),
        "passages_per_example": statistics.fmean(len(e.passages) for e in examples),
        "reference_format": REFERENCE_FORMAT,
        "strategies": {
            label: {name: _summary(tally) for name, tally in per_format.items()}
            for label, per_format in tallies.items()
        },
    }


def _stored_chunk(
    fmt: KVStorageFormat, ids: list[int], keys: torch.Tensor, values: torch.Tensor
) -> tuple[LoadedChunk, int]:
    """The chunk as a query reads it back from a blob in `fmt`, and the blob's bytes."""
    blob = encode_blob({**fmt.pack(keys, values), "tokens": torch.tensor(ids, dtype=torch.int32)})
    tensors = decode_blob(blob).tensors
    return LoadedChunk(ids, *fmt.unpack(tensors)), len(blob)


def _kv_bytes(tensors: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


def _summary(tally: dict[str, list[float]]) -> dict[str, float]:
    return {
        "first_token_kl": statistics.fmean(tally["kl"]),
        "first_token_kl_max": max(tally["kl"]),
        "top1_agreement": statistics.fmean(tally["top1"]),
        "answer_f1_vs_float16": statistics.fmean(tally["answer_f1"]),
        "bytes_per_token": round(sum(tally["bytes"]) / sum(tally["tokens"]), 1),
    }
