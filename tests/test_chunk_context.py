"""Chunks that carry context (ragkv.ingest.chunk_context) on a tiny model with a real LMDB store
and index: a chunk's stored K/V, recomputed in context, is what the model computes for
its rows after the context (the oracle: `chunk_kv` after a prefix cache holding the
context), and each chunk's context is its document's preceding chunk, then its nearest
chunk of another document."""

from __future__ import annotations

import pytest
import torch
from tiny_models import make_tiny_model

from ragkv.app.runtime import Runtime, RuntimeConfig
from ragkv.engine import EngineConfig
from ragkv.errors import InputError
from ragkv.ingest.chunk_keys import ChunkKeys
from ragkv.ingest.config import IngestConfig

CHUNK_TOKENS = 32
TEXTS = {
    "rivers": "The Danube flows through ten countries before it reaches the Black Sea. " * 6,
    "mountains": "Mont Blanc is the highest mountain of the Alps, on the French Italian border.",
    "bread": "Sourdough bread rises with wild yeast and lactic bacteria kept in a starter.",
}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_model("llama-sparse", tmp_path_factory.mktemp("tiny-llama-context"), tokenizer=True)


def _runtime(folder, home, neighbours: int) -> Runtime:
    engine = EngineConfig(
        model=str(folder), weights="float32", prefill_weights="float32", kv_cache_dtype="float32", kv_storage="float32"
    )
    ingest = IngestConfig(chunk_tokens=CHUNK_TOKENS, show_progress=False, context_neighbours=neighbours)
    return Runtime(RuntimeConfig(data_dir=home, engine=engine, ingest=ingest))


def _stored_kv(runtime: Runtime, chunk_hash: str) -> tuple[list[int], torch.Tensor, torch.Tensor]:
    tensors = runtime.store.get(ChunkKeys.of(runtime.engine).key("t", chunk_hash))
    keys, values = runtime.engine.kv_format.unpack(tensors)
    return tensors["tokens"].tolist(), keys.float(), values.float()


def _after(runtime: Runtime, context: list[list[int]], ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The oracle: the chunk's pre-RoPE K/V computed after the prefix and `context`."""
    model = runtime.engine.model
    cache = runtime.engine.chunk_prefix_cache().clone(extra_capacity=sum(map(len, context)))
    for part in context:
        model.prefill(torch.tensor(part), cache)
    keys, values = model.chunk_kv(torch.tensor(ids), cache)
    return keys.float(), values.float()


def test_chunks_are_recomputed_after_their_context(tiny, tmp_path):
    with _runtime(tiny, tmp_path, neighbours=1) as runtime:
        ids = {name: runtime.ingestor.ingest_text(text, name, tenant="t").doc_id for name, text in TEXTS.items()}
        plain = {
            name: [_stored_kv(runtime, c.chunk_hash) for c in runtime.registry.get("t", doc).chunks]
            for name, doc in ids.items()
        }
        result = runtime.contextualize("t", [ids["rivers"], ids["bread"]])
        rivers = runtime.registry.get("t", ids["rivers"]).chunks
        assert len(rivers) >= 3 and len(runtime.registry.get("t", ids["bread"]).chunks) == 1
        assert result.chunks == len(rivers) + 1

        # a later chunk of a document: after its preceding chunk, as the model computes it there
        for position in range(1, len(rivers)):
            tokens, keys, values = _stored_kv(runtime, rivers[position].chunk_hash)
            previous = plain["rivers"][position - 1][0]
            expected_keys, expected_values = _after(runtime, [previous], tokens)
            assert torch.allclose(keys, expected_keys, atol=1e-4), position
            assert torch.allclose(values, expected_values, atol=1e-4), position
            assert not torch.allclose(keys, plain["rivers"][position][1], atol=1e-3)

        # a document's first chunk: after its nearest chunk of another document
        tokens, keys, values = _stored_kv(runtime, runtime.registry.get("t", ids["bread"]).chunks[0].chunk_hash)
        candidates = [chunk[0] for name, chunks in plain.items() if name != "bread" for chunk in chunks]
        matches = [ctx for ctx in candidates if torch.allclose(keys, _after(runtime, [ctx], tokens)[0], atol=1e-4)]
        assert len(matches) == 1
        # documents not named keep the K/V ingestion computed
        assert torch.equal(
            _stored_kv(runtime, runtime.registry.get("t", ids["mountains"]).chunks[0].chunk_hash)[1],
            plain["mountains"][0][1],
        )


def test_context_is_on_by_default_can_be_turned_off_and_is_bounded(tiny, tmp_path):
    assert IngestConfig().context_neighbours == 2
    with _runtime(tiny, tmp_path, neighbours=0) as runtime:
        doc = runtime.ingestor.ingest_text(TEXTS["rivers"], "rivers", tenant="t").doc_id
        assert runtime.contextualizer is None and runtime.contextualize("t", [doc]) is None
    with pytest.raises(InputError, match="context_neighbours must be in"):
        IngestConfig(context_neighbours=9)


def test_the_recompute_runs_a_chunk_per_step_and_a_closed_one_writes_nothing(tiny, tmp_path):
    with _runtime(tiny, tmp_path, neighbours=1) as runtime:
        doc = runtime.ingestor.ingest_text(TEXTS["rivers"], "rivers", tenant="t").doc_id
        chunks = runtime.registry.get("t", doc).chunks
        plain = [_stored_kv(runtime, c.chunk_hash) for c in chunks]
        steps = runtime.contextualize_steps("t", [doc])
        assert [next(steps), next(steps)] == [1, 2]
        steps.close()  # a cancelled ingestion task: every blob as ingestion stored it
        for chunk, (_, keys, _) in zip(chunks, plain):
            assert torch.equal(_stored_kv(runtime, chunk.chunk_hash)[1], keys)
        steps = runtime.contextualize_steps("t", [doc])
        done = list(iter(lambda: next(steps, None), None))
        assert len(chunks) >= 3 and done == list(range(1, len(done) + 1)) and len(done) >= len(chunks) - 1
        changed = [not torch.equal(_stored_kv(runtime, c.chunk_hash)[1], k) for c, (_, k, _) in zip(chunks, plain)]
        assert sum(changed) == len(done) and all(changed[1:])  # every later chunk follows its preceding one
