"""Sparse decode selectors against references: dense attention, the exact oracle, and a
structured synthetic case whose important rows are known."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from sparse_cases import structured_case
from tiny_models import make_tiny_model

from ragkv.bench.sparse_bench import RecallMeter
from ragkv.engine.model import CausalLM
from ragkv.sparse import A2ATSCodebook, PromptState, SparseConfig, selector_names
from ragkv.sparse.base import EXTEND_BATCH
from ragkv.sparse.calibrate import CalibrationConfig, calibrate, fit_codebook
from ragkv.sparse.oracle import attention_mass
from ragkv.sparse.prompt import unrotate_keys

SELECTORS = selector_names()
ROWS = 320


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return CausalLM.load(make_tiny_model("llama-sparse", tmp_path_factory.mktemp("tiny-llama")))


@pytest.fixture(scope="module")
def codebook(model):
    text = ["the quick brown fox jumps over the lazy dog " * 40, "0123456789 abcdefghij " * 30]
    config = CalibrationConfig(codebook_size=32, tokens=768, sequence_tokens=256, iterations=4)
    return calibrate(model, lambda s: [b % 500 + 3 for b in s.encode()], text, [5, 6, 7], config)


@pytest.fixture(scope="module")
def prompt_ids():
    return torch.randint(3, 500, (ROWS,), generator=torch.Generator().manual_seed(3))


def prefilled(model, ids, extra=16):
    cache = model.new_cache(ids.numel() + extra)
    logits = model.prefill(ids, cache)
    return cache, logits


def greedy(model, cache, logits, attention, steps):
    out, token = [], int(logits.argmax())
    for _ in range(steps):
        logits = model.decode_step(token, cache, attention)
        out.append(logits)
        token = int(logits.argmax())
    return torch.stack(out)


@pytest.mark.parametrize("selector", SELECTORS)
def test_budget_covering_everything_equals_dense(model, codebook, prompt_ids, selector):
    cache, logits = prefilled(model, prompt_ids)
    reference = greedy(model, cache.clone(16), logits, None, 6)
    work = cache.clone(16)
    config = SparseConfig(selector=selector, budget=1.0, window=8)
    attention = config.build(PromptState.from_prefill(model, work, prompt_ids, 3, ROWS - 12), codebook)
    torch.testing.assert_close(greedy(model, work, logits, attention, 6), reference, rtol=1e-4, atol=1e-4)
    # and one call against the dense formula directly
    q = torch.randn(model.spec.num_heads, 1, model.spec.head_dim)
    keys, values = work.layer(1)
    expected = F.scaled_dot_product_attention(q, keys, values, scale=model.scale, enable_gqa=True)
    torch.testing.assert_close(attention(1, q, work, model.scale), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("selector", ("oracle", "a2ats", "pqcache", "lrqk"))
def test_sparse_step_is_exact_attention_over_the_chosen_rows(model, codebook, prompt_ids, selector):
    cache, _ = prefilled(model, prompt_ids)
    config = SparseConfig(selector=selector, budget=40, sinks=2, window=6)
    attention = config.build(PromptState.from_prefill(model, cache, prompt_ids, 3, ROWS - 12), codebook)
    q = torch.randn(model.spec.num_heads, 1, model.spec.head_dim, generator=torch.Generator().manual_seed(0))
    seen = {}
    attention.observer = lambda layer, q_, c, indices, start, end: seen.update(indices=indices, start=start, end=end)
    out = attention(0, q, cache, model.scale)
    indices = seen["indices"]
    assert indices.shape == (model.spec.num_kv_heads, 40)
    recent = 6 + attention.extra_recent  # lrqk's lite rows extend the window
    assert (seen["start"], seen["end"]) == (2, ROWS - recent)
    for head in range(model.spec.num_kv_heads):
        rows = indices[head]
        assert rows.unique().numel() == 40
        assert set(range(2)) | set(range(ROWS - recent, ROWS)) <= set(rows.tolist())  # sinks and window always
    keys, values = cache.layer(0)
    group = model.spec.group_size
    for h in range(model.spec.num_heads):
        rows = indices[h // group]
        expected = F.scaled_dot_product_attention(
            q[h : h + 1], keys[h // group, rows].unsqueeze(0), values[h // group, rows].unsqueeze(0), scale=model.scale
        )
        torch.testing.assert_close(out[h], expected[0], rtol=1e-5, atol=1e-5)


def test_budget_definition():
    config = SparseConfig(budget=0.06, sinks=4, window=64)
    assert config.budget_rows(8192) == math.ceil(0.06 * 8192) == 492
    assert SparseConfig(budget=100).budget_rows(8192) == 100
    assert SparseConfig(budget=100).budget_rows(50) == 50
    assert SparseConfig(budget=1.0).budget_rows(777) == 777
    with pytest.raises(ValueError):
        SparseConfig(budget=10.5)
    with pytest.raises(ValueError):
        SparseConfig(selector="nope")
    with pytest.raises(ValueError):
        SparseConfig(window=0)
    with pytest.raises(ValueError):
        SparseConfig(head_aggregation="max")


def test_budget_below_the_fixed_rows_keeps_only_sinks_and_window(model, prompt_ids, codebook):
    cache, _ = prefilled(model, prompt_ids)
    attention = SparseConfig(selector="oracle", budget=5, sinks=4, window=8).build(
        PromptState.from_prefill(model, cache, prompt_ids), codebook
    )
    assert attention.span(ROWS) == (4, ROWS - 8, 0)
    seen = {}
    attention.observer = lambda layer, q, c, indices, start, end: seen.update(indices=indices)
    attention(0, torch.randn(model.spec.num_heads, 1, model.spec.head_dim), cache, model.scale)
    assert seen["indices"][0].tolist() == list(range(4)) + list(range(ROWS - 8, ROWS))


def test_oracle_takes_the_mass_optimal_rows(model, prompt_ids, codebook):
    cache, logits = prefilled(model, prompt_ids, extra=16)
    attention = SparseConfig(selector="oracle", budget=0.2, window=8).build(
        PromptState.from_prefill(model, cache, prompt_ids)
    )
    meter = RecallMeter(model.scale)
    attention.observer = meter
    greedy(model, cache, logits, attention, 4)
    assert len(meter.recalls) == 4 * model.spec.num_layers * model.spec.num_kv_heads
    assert min(meter.recalls) == pytest.approx(1.0, abs=1e-5)


def synthetic_codebook(model, keys, question, rows):
    spec = model.spec
    moments = torch.zeros(spec.num_layers, spec.num_kv_heads, spec.head_dim, spec.head_dim, dtype=torch.float64)
    for layer in range(spec.num_layers):
        window = question[layer].shape[1]
        rotated = model.rotary.rotate(question[layer], 2048 - torch.arange(rows - window, rows)).double()
        pooled = rotated.reshape(spec.num_kv_heads, -1, spec.head_dim)
        moments[layer] = torch.einsum("hnd,hne->hde", pooled, pooled)
    centroids, transform = fit_codebook(
        [keys[layer] for layer in range(spec.num_layers)],
        moments,
        1,
        CalibrationConfig(codebook_size=64, iterations=10),
    )
    return A2ATSCodebook(centroids, transform, 2048, keys.mean(2))


@pytest.mark.parametrize("aggregation", ("probs", "logits"))
def test_approximate_selectors_recall_structured_case(model, aggregation):
    rows = 1024
    cache, keys, query, question = structured_case(model, rows)
    codebook = synthetic_codebook(model, keys, question, rows)
    spec = model.spec
    ids = torch.zeros(rows, dtype=torch.long)
    budget = 0.1

    def recall_of(selector: str) -> float:
        work = cache.clone(8)
        prompt = PromptState.from_prefill(model, work, ids, 4, rows - 16)
        prompt._queries = question  # the question window's queries (the probe needs a real model)
        config = SparseConfig(selector=selector, budget=budget, window=16, head_aggregation=aggregation)
        attention = config.build(prompt, codebook)
        meter = RecallMeter(model.scale)
        attention.observer = meter
        work.length = rows + 1  # a decode row at position `rows` (zero key/value)
        work.keys[:, :, rows] = 0
        work.values[:, :, rows] = 0
        for seed in range(3):
            for layer, q in enumerate(query(seed)):
                attention(layer, q, work, model.scale)
        return sum(meter.recalls) / len(meter.recalls)

    # random choice of the same number of rows, for scale
    generator = torch.Generator().manual_seed(0)
    random_recalls = []
    work = cache.clone(8)
    work.length = rows + 1
    work.keys[:, :, rows] = 0
    for layer, q in enumerate(query(0)):
        mass = attention_mass(q, work.keys[layer, :, : rows + 1], model.scale)[:, 4 : rows + 1 - 16]
        k = math.ceil(budget * (rows + 1)) - 4 - 16
        for head in range(spec.num_kv_heads):
            pick = torch.randperm(mass.shape[1], generator=generator)[:k]
            random_recalls.append(float(mass[head, pick].sum() / mass[head].topk(k).values.sum()))
    random_recall = sum(random_recalls) / len(random_recalls)
    assert random_recall < 0.3
    for selector in ("a2ats", "pqcache", "lrqk"):
        assert recall_of(selector) > random_recall + 0.5, selector


def test_decoded_rows_get_state_as_they_leave_the_window(model, codebook, prompt_ids):
    cache, logits = prefilled(model, prompt_ids, extra=40)
    config = SparseConfig(selector="a2ats", budget=0.3, window=4, sinks=2)
    attention = config.build(PromptState.from_prefill(model, cache, prompt_ids), codebook)
    greedy(model, cache, logits, attention, 30)
    spec = model.spec
    for layer in range(spec.num_layers):
        ready = attention.ready[layer]
        assert ROWS + 30 - 4 - EXTEND_BATCH <= ready <= ROWS + 30 - 4  # candidates get codes, EXTEND_BATCH at a time
        pre = unrotate_keys(model, cache.keys[layer, :, :ready], torch.arange(ready))
        assert torch.equal(attention.codes.rows(layer, 0, ready), codebook.encode_layer(layer, pre))


def test_logit_aggregation_uses_the_code_kernel_consistently(model, codebook, prompt_ids):
    """With plain WRoPE and summed logits, a2ats's kernel top-k equals scoring the
    group-summed rotated query against each row's centroid by hand."""
    cache, _ = prefilled(model, prompt_ids)
    config = SparseConfig(
        selector="a2ats:mean_key=false,rerank=0", budget=60, window=8, sinks=4, head_aggregation="logits"
    )
    attention = config.build(PromptState.from_prefill(model, cache, prompt_ids), codebook)
    q = torch.randn(model.spec.num_heads, 1, model.spec.head_dim, generator=torch.Generator().manual_seed(5))
    layer, start, end, k = 1, 4, ROWS - 8, 60 - 12
    chosen = attention.select(layer, q, cache, start, end, k)
    heads, group = model.spec.num_kv_heads, model.spec.group_size
    rotated = model.rotary.rotate(q, torch.tensor([codebook.offset - cache.next_position]))[:, 0]
    summed = rotated.view(heads, group, -1).sum(1)
    codes = attention.codes.rows(layer, start, end).long()
    scores = torch.einsum("hd,hnd->hn", summed, codebook.centroids[layer][torch.arange(heads).unsqueeze(1), codes])
    expected = scores.topk(k).indices + start
    for head in range(heads):
        assert set(chosen[head].tolist()) == set(expected[head].tolist())


def test_a2ats_rerank_keeps_the_most_mass_among_its_candidates(model, codebook, prompt_ids):
    """With rerank, the kept rows are the exact-mass top k of the candidates the codes
    picked; with every row a candidate that is the oracle's choice."""
    cache, _ = prefilled(model, prompt_ids)
    q = torch.randn(model.spec.num_heads, 1, model.spec.head_dim, generator=torch.Generator().manual_seed(5))
    chosen = {}
    for spec in ("oracle", f"a2ats:rerank={ROWS}"):
        attention = SparseConfig(selector=spec, budget=40, sinks=2, window=6).build(
            PromptState.from_prefill(model, cache, prompt_ids, 3, ROWS - 12), codebook
        )
        attention.observer = lambda layer, q_, c, indices, start, end, s=spec: chosen.update({s: indices})
        attention(1, q, cache, model.scale)
    for head in range(model.spec.num_kv_heads):
        assert set(chosen["oracle"][head].tolist()) == set(chosen[f"a2ats:rerank={ROWS}"][head].tolist())
    with pytest.raises(ValueError, match="rerank"):
        SparseConfig(selector="a2ats:rerank=0.5")
