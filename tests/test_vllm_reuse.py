"""The vLLM connector's parts that need no vLLM: the paged layout map, the scheduler's
decision, the rows a prompt's plan provides and what is saved of a prompt vLLM computed.
(tests/test_vllm_connector.py runs the whole connector inside a real vLLM.)"""

from __future__ import annotations

import pytest
import torch
from tiny_models import make_tiny_model

from ragkv.app.passages import SpanKeys
from ragkv.engine import Engine
from ragkv.engine.core import chunk_fingerprint
from ragkv.store.url import open_store
from ragkv.vllm.config import ConnectorConfig
from ragkv.vllm.paged import PagedLayout, slots_of
from ragkv.vllm.reuse import FUSE, NONE, PREFIX, Planner, Rows, prefix_fingerprint


def _cpu_like_write(keys, values, cache, slots):
    """vLLM's CPU backend: a block is [heads, rows, 2 * D] holding its rows' keys, then values."""
    rows = cache.shape[2]
    view = cache.view(cache.shape[0], cache.shape[1], 2 * rows, -1)
    for i, slot in enumerate(slots.tolist()):
        view[slot // rows, :, slot % rows] = keys[i]
        view[slot // rows, :, rows + slot % rows] = values[i]


def _split_write(keys, values, cache, slots):
    """Another layout: a block is [heads, rows, 2, D] (K and V interleaved per token)."""
    rows = cache.shape[2]
    view = cache.view(cache.shape[0], cache.shape[1], rows, 2, -1)
    for i, slot in enumerate(slots.tolist()):
        view[slot // rows, :, slot % rows, 0] = keys[i]
        view[slot // rows, :, slot % rows, 1] = values[i]


@pytest.mark.parametrize("write", [_cpu_like_write, _split_write])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_layout_map_reads_what_the_backend_wrote(write, dtype):
    blocks, heads, rows, dim = 6, 3, 32, 16
    cache = torch.zeros(blocks, heads, rows, 2 * dim, dtype=dtype)
    layout = PagedLayout(write, cache, heads, dim)
    block_ids = [4, 1, 5]
    slots = slots_of(block_ids, rows, 10, 80)
    keys, values = torch.randn(heads, 70, dim).to(dtype), torch.randn(heads, 70, dim).to(dtype)
    layout.write_rows(cache, slots, keys, values)
    read_keys, read_values = layout.read(cache, slots)
    assert torch.equal(read_keys, keys) and torch.equal(read_values, values)
    assert slots[0] == 4 * rows + 10 and slots[-1] == 5 * rows + 79 - 64


def test_a_quantised_cache_is_refused():
    with pytest.raises(ValueError, match="quantised"):
        PagedLayout(_cpu_like_write, torch.zeros(2, 1, 32, 8, dtype=torch.uint8), 1, 4)


@pytest.fixture
def parts(tmp_path_factory):
    """A tiny model over a store of its own per test: what one test saves, another does
    not find (the tests run in any order)."""
    root = tmp_path_factory.mktemp("vllm-reuse")
    (root / "model").mkdir()
    folder = make_tiny_model("llama-sparse", root / "model", tokenizer=True, head_dim=32)
    config = ConnectorConfig(
        store_url=f"lmdb://{root / 'store'}",
        min_prefix_tokens=16,
        engine={"weights": "float32", "kv_storage": "float32"},
    )
    engine_config = config.engine_config(str(folder), "float32")
    engine = Engine(engine_config)
    fingerprint = chunk_fingerprint(engine_config, engine.model_dir)
    assert fingerprint == engine.fingerprint  # the scheduler side finds what the worker side stores
    store = open_store(config.store_url)
    planner = Planner(
        config, SpanKeys(engine.tokenizer, fingerprint), store, prefix_fingerprint(fingerprint, "float32")
    )
    yield engine, planner, Rows(config, engine, store, planner)
    store.close()


def _prompt(engine, order, edited=False):
    """`edited`: one word in the middle of each note is another."""
    words = "river stone garden lantern copper violet harbor meadow".split()

    def word(i: int, j: int) -> str:
        return "granite" if edited and j == 20 else words[(i + j) % 8]

    passages = [f"Note {i}: " + " ".join(f"{word(i, j)} {i}{j}" for j in range(40)) for i in range(3)]
    text = "\n\n".join(passages[i] for i in order) + "\n\nQuestion: which note?"
    messages = [{"role": "user", "content": text}]
    return list(engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False))


def test_a_computed_prompt_is_saved_then_loaded_and_its_spans_fused(parts):
    engine, planner, rows = parts
    seen, shuffled = _prompt(engine, [0, 1, 2]), _prompt(engine, [2, 0, 1])
    assert planner.decide(seen, 0).mode == NONE
    cache, _ = engine.prefill(seen)  # stands for vLLM's rows: post-RoPE
    keys, values = cache.keys[:, :, : len(seen) - 1], cache.values[:, :, : len(seen) - 1]
    assert rows.save(seen, keys, values, whole=True) == {"prefix": len(seen) - 1, "spans": 3}

    decision = planner.decide(seen, 32)
    assert (decision.mode, decision.tokens) == (PREFIX, len(seen) - 1 - 32)
    stored_keys, stored_values = rows.prefix_rows(seen)
    assert torch.equal(stored_keys, keys) and torch.equal(stored_values, values)

    # each span was stored pre-RoPE: rotated back to where it stood, it is vLLM's key again
    found = planner.keys.find("default", seen, 0)
    for span, key in zip(found.spans, found.keys):
        pre_rope = engine.kv_format.dense_keys(planner.store.get(key), torch.float32)
        rotated = engine.model.rotary_of(0).rotate(pre_rope[0], torch.arange(span.start, span.end))
        torch.testing.assert_close(rotated, keys[0, :, span.start : span.end].float(), atol=1e-4, rtol=1e-4)

    decision = planner.decide(shuffled, 0)
    assert decision.mode == FUSE and decision.tokens == len(shuffled) - 1
    fused_keys, fused_values, info = rows.fused_rows(shuffled, "full")
    assert info["hits"] == 3 and info["misses"] == 0
    full, _ = engine.prefill(shuffled)
    n = len(shuffled)
    torch.testing.assert_close(fused_keys, full.keys[:, :, :n], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(fused_values, full.values[:, :, :n], atol=1e-4, rtol=1e-4)


def test_the_connector_engine_takes_vllms_dtype_and_ragkvs_own_formats():
    from ragkv.engine.config import EngineConfig

    plain = ConnectorConfig().engine_config("/models/m", "float32")
    ingestion = EngineConfig(model="/models/m", dtype="float32")
    # the same numerics as `ragkv ingest --model /models/m`: one chunk key space
    assert plain.numerics() == ingestion.numerics()
    assert (plain.prefill_weights, plain.kv_cache_dtype) == ("auto", "auto")
    pinned = ConnectorConfig(engine={"prefill_weights": "float32", "kv_cache_dtype": "float32"})
    exact = pinned.engine_config("/models/m", "bfloat16")
    assert (exact.dtype, exact.prefill_weights, exact.kv_cache_dtype) == ("bfloat16", "float32", "float32")
    with pytest.raises(ValueError, match="unknown kv_connector_extra_config"):
        ConnectorConfig.from_extra({"prefill_weights": "float32"})


def test_spans_saved_from_vllm_are_found_by_their_anchors_inside_another_passage(parts):
    engine, planner, rows = parts
    seen = _prompt(engine, [0, 1, 2])
    cache, _ = engine.prefill(seen)
    rows.save(seen, cache.keys[:, :, : len(seen) - 1], cache.values[:, :, : len(seen) - 1], whole=True)
    saved = planner.keys.find("default", seen, 0)
    # the notes edited in the middle: no span's whole tokens were saved, their stretches were
    edited = _prompt(engine, [0, 1, 2], edited=True)
    plan = rows.passages.plan("default", edited, 0)
    assert plan is not None and not set(plan.digests) & set(saved.digests)
    assert plan.placed and {piece.run for piece in plan.placed} <= set(saved.digests)
    for piece in plan.placed:  # the placed rows are a stretch of the saved span's tokens
        run = planner.store.get(planner.keys.chunk_keys.key("default", piece.run))["tokens"].tolist()
        stretch = edited[piece.start : piece.end]
        assert any(run[i : i + len(stretch)] == stretch for i in range(len(run) - len(stretch) + 1))
