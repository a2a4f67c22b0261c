"""KV storage formats with the packaged model: the fingerprint separates formats, fused
prompts from integer-coded chunks stay close to float16 ones, and a chunk evicted from a
bounded store is recomputed from the registry's text and put back."""

from __future__ import annotations

import pytest
import torch

from ragkv.app.rag import RagPipeline
from ragkv.engine.fingerprint import model_fingerprint
from ragkv.engine.kv_storage import KV_STORAGE_FORMATS
from ragkv.fusion import FullReuse, FusionInput, LoadedChunk
from ragkv.fusion.fidelity import next_token_kl
from ragkv.ingest.embedder import Embedder
from ragkv.ingest.journal import IngestJournal
from ragkv.ingest.pipeline import IngestConfig, Ingestor
from ragkv.ingest.registry_lmdb import LMDBDocumentRegistry
from ragkv.store.keys import ChunkKey, hash_tokens
from ragkv.store.lmdb_env import LMDBEnvironment
from ragkv.store.lmdb_store import LMDBStore

TEXTS = [
    "Gull Point Light was first lit on 3 March 1851 and burned whale oil until 1890. " * 4,
    "Linden Hill Orchard grows nineteen apple varieties on twelve hectares of slope. " * 4,
    "Hallerberg Observatory sits at 1,240 metres on the ridge above the valley towns. " * 4,
]
QUESTION = "When was Gull Point Light first lit?"


def test_every_format_has_its_own_fingerprint(engine):
    prints = {
        name: model_fingerprint(
            engine.model_dir, engine.model.spec, fmt.descriptor, engine.chunk_prefix_ids, engine.model.numerics
        )
        for name, fmt in KV_STORAGE_FORMATS.items()
    }
    assert len(set(prints.values())) == len(prints)
    assert prints[engine.config.kv_storage] == engine.fingerprint


@pytest.fixture(scope="module")
def raw_chunks(engine):
    chunks = []
    for text in TEXTS:
        ids = engine.tokenize(text)
        keys, values = engine.model.chunk_kv(torch.tensor(ids), engine.chunk_prefix_cache())
        chunks.append((ids, keys, values))
    return chunks


def _first_token_logits(engine, raw_chunks, fmt_name: str) -> torch.Tensor:
    fmt = KV_STORAGE_FORMATS[fmt_name]
    chunks = [LoadedChunk(ids, *fmt.unpack(fmt.pack(keys, values))) for ids, keys, values in raw_chunks]
    segments = engine.prompt.rag_segments(QUESTION)
    fusion_input = FusionInput(
        segments.prefix_ids, chunks, segments.question_ids, len(engine.chunk_prefix_ids), segments.question_text_span
    )
    # full_reuse recomputes nothing of the chunks: every stored error reaches the logits.
    return FullReuse().fuse(engine.model, fusion_input, engine.chunk_prefix_cache()).logits


@pytest.mark.parametrize("name,max_kl", [("bfloat16", 2e-3), ("int8", 2e-3), ("int4", 0.05)])
def test_quantised_chunks_fuse_close_to_float16(engine, raw_chunks, name, max_kl):
    reference = _first_token_logits(engine, raw_chunks, "float16")
    logits = _first_token_logits(engine, raw_chunks, name)
    assert next_token_kl(reference, logits) < max_kl
    assert int(logits.argmax()) == int(reference.argmax())


@pytest.fixture(scope="module")
def embedder():
    return Embedder()


def test_an_evicted_chunk_is_recomputed_and_put_back(engine, embedder, tmp_path):
    env = LMDBEnvironment(tmp_path / "db")
    probe = engine.encode_chunk(engine.tokenize(TEXTS[0])[:64])
    with LMDBStore(tmp_path / "probe") as sizing:
        sizing.put(ChunkKey(engine.fingerprint, hash_tokens([1, 2, 3]), 1), probe)
        one_chunk = sizing.stats().bytes
    store = LMDBStore(tmp_path / "db", capacity_bytes=2 * one_chunk)
    try:
        ingestor = Ingestor(
            engine,
            store,
            LMDBDocumentRegistry(env),
            embedder,
            IngestJournal(env),
            IngestConfig(chunk_tokens=64, show_progress=False),
        )
        doc_ids = [ingestor.ingest_text(text, f"t{i}.txt").doc_id for i, text in enumerate(TEXTS)]
        assert store.stats().evictions > 0
        record = ingestor.registry.get("default", doc_ids[0])
        evicted = [
            chunk for chunk in record.chunks if not store.contains(ingestor.chunk_key("default", chunk.chunk_hash))
        ]
        assert evicted, "the first document's chunks should have been evicted by the later ones"

        rag = RagPipeline(engine, store, ingestor.registry, embedder)
        retrieved = [(record, chunk, 0.0) for chunk in evicted]
        loaded, recomputed = rag.load_chunks("default", retrieved)
        assert recomputed == list(range(len(evicted)))
        for chunk, got in zip(evicted, loaded):
            assert store.contains(ingestor.chunk_key("default", chunk.chunk_hash))  # put back
            tokens = engine.tokenize(TEXTS[0])[chunk.token_start : chunk.token_end]
            expected = LoadedChunk(tokens, *engine.kv_format.unpack(engine.encode_chunk(tokens)))
            assert got.token_ids == tokens
            for mine, theirs in ((got.keys, expected.keys), (got.values, expected.values)):
                _assert_same_stored(mine, theirs)
    finally:
        store.close()
        env.close()


def _assert_same_stored(mine, theirs) -> None:
    if isinstance(mine, torch.Tensor):
        assert torch.equal(mine, theirs)
    else:
        for part in ("codes", "scale", "minimum"):
            assert torch.equal(getattr(mine, part), getattr(theirs, part))
