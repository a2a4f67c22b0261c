"""A2ATS codebooks: calibration, storage in LMDB, codes stored at ingestion versus codes
computed at query time, staleness, fresh codes for recomputed rows, and the RAG wiring."""

from __future__ import annotations

import os

import pytest
import torch
from tiny_models import make_tiny_model

from ragkv.app.codebooks import CODEBOOK_DB, load_codebook, save_codebook, stored_codebook
from ragkv.app.generate import decode
from ragkv.engine import Engine, EngineConfig
from ragkv.engine.generation import GenerationConfig
from ragkv.engine.kv_storage import dense
from ragkv.fusion import FusionConfig, FusionInput, LoadedChunk
from ragkv.sparse import A2ATSCodebook, PromptState, SparseConfig
from ragkv.sparse.calibrate import CalibrationConfig, calibrate
from ragkv.sparse.codebook import ScoringCentroids
from ragkv.sparse.prompt import unrotate_keys
from ragkv.sparse.wiring import sparse_attention, sparse_chunk_codes
from ragkv.store.errors import CorruptBlobError
from ragkv.store.lmdb_env import LMDBEnvironment
from ragkv.store.url import open_store

TEXT = (
    "Calibration text about rivers, mountains and the cities built along them. "
    "Numbers 12 345 6789 and names like Exeter College appear here too. "
) * 12


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    folder = make_tiny_model("llama-sparse", tmp_path_factory.mktemp("tiny-llama-tok"), tokenizer=True)
    previous = os.environ.get("RAGKV_CACHE")
    os.environ["RAGKV_CACHE"] = str(tmp_path_factory.mktemp("ragkv-cache"))  # weight digests stay out of ~/.cache
    try:
        yield Engine(EngineConfig(model=str(folder)))
    finally:
        if previous is None:
            os.environ.pop("RAGKV_CACHE", None)
        else:
            os.environ["RAGKV_CACHE"] = previous


def make_codebook(engine, seed=0, size=32) -> A2ATSCodebook:
    config = CalibrationConfig(codebook_size=size, tokens=512, sequence_tokens=128, iterations=4, seed=seed)
    return calibrate(engine.model, engine.tokenize, [TEXT], engine.chunk_prefix_ids, config)


@pytest.fixture(scope="module")
def codebook(engine):
    return make_codebook(engine)


@pytest.mark.model
def test_calibration_shapes_and_uuid_mix(engine, codebook):
    spec = engine.spec
    assert codebook.centroids.shape == (spec.num_layers, spec.num_kv_heads, 32, spec.head_dim)
    assert codebook.transform.shape == (spec.num_layers, spec.num_kv_heads, spec.head_dim, spec.head_dim)
    assert torch.equal(codebook.transform, codebook.transform.tril())  # a Cholesky factor
    assert int(codebook.info["tokens"]) == 512 and codebook.info["uuid_share"] == "0.1"
    # deterministic for a seed, different for another
    assert make_codebook(engine).id == codebook.id
    assert make_codebook(engine, seed=1).id != codebook.id


def test_scoring_centroids_round_each_centroid_to_int8_within_half_a_step():
    centroids = torch.randn(2, 3, 40, 16) * torch.logspace(-3, 2, 40).view(1, 1, 40, 1)
    centroids[0, 0, 5] = 0  # a zero centroid keeps a zero scale
    rounded = ScoringCentroids.rounded(centroids)
    assert rounded.codes.dtype == torch.int8 and rounded.scales.dtype == torch.float32
    nonzero = rounded.scales > 0
    assert (rounded.codes.abs().amax(-1)[nonzero] == 127).all()  # each centroid's largest coordinate
    assert rounded.scales[0, 0, 5] == 0 and not rounded.codes[0, 0, 5].any()
    error = (rounded.values() - centroids).abs()
    assert (error <= rounded.scales.unsqueeze(-1) / 2 * (1 + 1e-5)).all()
    relative = error.amax(-1) / centroids.abs().amax(-1).clamp_min(1e-30)
    assert relative.max() <= 0.5 / 127 * (1 + 1e-5)


@pytest.mark.model
def test_codebook_round_trips_through_lmdb(tmp_path, engine, codebook):
    with LMDBEnvironment(tmp_path / "db") as env:
        assert load_codebook(env, engine.fingerprint) is None
        save_codebook(env, engine.fingerprint, codebook)
        loaded = load_codebook(env, engine.fingerprint)
        assert loaded.id == codebook.id and loaded.offset == codebook.offset and loaded.info == codebook.info
        for name in ("centroids", "transform", "key_mean"):
            assert torch.equal(getattr(loaded, name), getattr(codebook, name))
        assert load_codebook(env, "another-model") is None
        other = make_codebook(engine, seed=2)
        save_codebook(env, engine.fingerprint, other)  # recalibrating replaces it
        assert load_codebook(env, engine.fingerprint).id == other.id
        assert stored_codebook(engine, env).id == other.id
        # a damaged blob is refused, never half-read
        db = env.db(CODEBOOK_DB)
        key = f"a2ats/{engine.fingerprint}".encode()
        with env.read() as txn:
            raw = bytearray(txn.get(key, db=db))
        raw[-5] ^= 0xFF
        env.write(lambda txn: txn.put(key, bytes(raw), db=db))
        with pytest.raises(CorruptBlobError):
            load_codebook(env, engine.fingerprint)


def ingest_chunks(engine, tmp_path, codebook, count=3):
    """Encode chunks with `codebook`, write them to an LMDB store and read them back."""
    from ragkv.store.keys import ChunkKey, hash_tokens

    store = open_store(f"lmdb://{tmp_path / 'store'}")
    generator = torch.Generator().manual_seed(4)
    texts = [" ".join(str(int(x)) for x in torch.randint(0, 10_000, (40,), generator=generator)) for _ in range(count)]
    stored = []
    for text in texts:
        tokens = engine.tokenize(text)
        key = ChunkKey(engine.fingerprint, hash_tokens(tokens), 1)
        store.put(key, engine.encode_chunk(tokens, codebook))
        stored.append(store.get(key))
    store.close()
    chunks = [LoadedChunk(t["tokens"].tolist(), *engine.kv_format.unpack(t)) for t in stored]
    return chunks, stored


def fuse(engine, chunks, strategy, ratio=0.3):
    segments = engine.prompt.rag_segments("Which number comes first?")
    fusion_input = FusionInput(
        segments.prefix_ids, chunks, segments.question_ids, len(engine.chunk_prefix_ids), segments.question_text_span
    )
    return (
        FusionConfig(strategy=strategy, ratio=ratio)
        .build()
        .fuse(engine.model, fusion_input, engine.chunk_prefix_cache(), 8)
    )


@pytest.mark.model
def test_codes_stored_at_ingestion_equal_codes_at_query_time(tmp_path, engine, codebook):
    chunks, stored = ingest_chunks(engine, tmp_path, codebook)
    for chunk, tensors in zip(chunks, stored):
        assert tensors["codes"].dtype == torch.int16
        assert tensors["codes"].shape == chunk.keys.shape[:3]
        # the codes of the keys exactly as a query reads them back from the store
        assert torch.equal(tensors["codes"], codebook.encode(dense(chunk.keys, torch.float32)))
    config = SparseConfig(selector="a2ats", budget=1.0)
    codes = sparse_chunk_codes(engine, codebook, config, chunks, stored)
    assert all(torch.equal(c, t["codes"]) for c, t in zip(codes, stored))
    result = fuse(engine, chunks, "pie")  # chunk rows keep their stored K/V at every layer
    selector = config.build(PromptState.from_fusion(engine.model, result, codes), codebook)
    model, spec = engine.model, engine.spec
    for layer in range(spec.num_layers):
        for (start, end), tensors in zip(result.layout.chunk_spans, stored):
            assert torch.equal(selector.codes.rows(layer, start, end), tensors["codes"][layer])
            # recomputing from the fused cache (keys rotated to their global positions) agrees
            pre = unrotate_keys(model, result.cache.keys[layer, :, start:end], torch.arange(start, end))
            agree = (codebook.encode_layer(layer, pre) == tensors["codes"][layer]).float().mean()
            assert agree >= 0.99


@pytest.mark.model
def test_changed_codebook_never_serves_stale_codes(tmp_path, engine, codebook):
    chunks, stored = ingest_chunks(engine, tmp_path, codebook)
    newer = make_codebook(engine, seed=7)
    assert newer.id != codebook.id
    assert newer.codes_of(stored[0]) is None and codebook.codes_of(stored[0]) is not None
    codes = sparse_chunk_codes(engine, newer, SparseConfig(selector="a2ats"), chunks, stored)
    for chunk, got in zip(chunks, codes):
        assert torch.equal(got, newer.encode(dense(chunk.keys, torch.float32)))
    # chunks stored without codes (ingested before calibration) get them computed too
    bare = [{k: v for k, v in t.items() if k not in ("codes", "codebook_id")} for t in stored]
    codes = sparse_chunk_codes(engine, codebook, SparseConfig(selector="a2ats"), chunks, bare)
    assert all(torch.equal(got, t["codes"]) for got, t in zip(codes, stored))


@pytest.mark.model
def test_recomputed_rows_get_fresh_codes(tmp_path, engine, codebook):
    chunks, stored = ingest_chunks(engine, tmp_path, codebook)
    result = fuse(engine, chunks, "a3", ratio=0.3)
    codes = [t["codes"] for t in stored]
    selector = SparseConfig(selector="a2ats", budget=1.0).build(
        PromptState.from_fusion(engine.model, result, codes), codebook
    )
    model = engine.model
    changed = 0
    for layer in range(engine.spec.num_layers):
        recomputed = set(result.recomputed_rows(layer).tolist())
        for (start, end), stored_codes in zip(result.layout.chunk_spans, codes):
            for row in range(start, end):
                got = selector.codes.rows(layer, row, row + 1)[:, 0]
                if row in recomputed:
                    pre = unrotate_keys(model, result.cache.keys[layer, :, row : row + 1], torch.tensor([row]))
                    assert torch.equal(got, codebook.encode_layer(layer, pre)[:, 0])
                    changed += int(not torch.equal(got, stored_codes[layer, :, row - start]))
                else:
                    assert torch.equal(got, stored_codes[layer, :, row - start])
    assert changed > 0  # recomputation really changed some keys' codes


@pytest.mark.model
def test_a_fused_prompt_decodes_with_the_configured_selector(tmp_path, engine, codebook):
    chunks, stored = ingest_chunks(engine, tmp_path, codebook)
    generation = GenerationConfig(max_new_tokens=6)

    def answer(sparse):
        result = fuse(engine, chunks, "a3")
        codes = sparse_chunk_codes(engine, codebook, sparse, chunks, stored)
        attention = sparse_attention(engine, codebook, sparse, result, codes)  # what a query request decodes with
        return decode(engine, result.cache, result.logits, generation, attention).token_ids

    dense = answer(None)
    for selector in ("dense", "oracle", "a2ats", "pqcache", "lrqk"):
        assert answer(SparseConfig(selector=selector, budget=1.0, window=8)) == dense, selector
    assert len(answer(SparseConfig(selector="a2ats", budget=0.3, window=8, snapkv_capacity=80))) >= 1
    with pytest.raises(ValueError, match="calibrate"):
        sparse_chunk_codes(engine, None, SparseConfig(selector="a2ats"), chunks, stored)
