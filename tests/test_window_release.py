"""Decode that lets Gemma 3's sliding-window layers release rows their window no longer
reaches (KVCache.release_window_rows), on a tiny random Gemma 3 (window 8): the logits
equal those of the untrimmed cache's decode step for step, the windowed layers hold at most
window - 1 + slack rows, and the cache can still be extended, copied, stored and restored,
but not cut before its window."""

from __future__ import annotations

import pytest
import torch
from tiny_models import make_tiny_model

from ragkv.app.chat.context_blob import decode_context, encode_context
from ragkv.app.chat.contexts import Context
from ragkv.engine.kv_cache import window_slack
from ragkv.engine.model import CausalLM

PROMPT, STEPS = 12, 60
"""A prompt shorter than window + slack, and a decode far past both."""


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    model = CausalLM.load(make_tiny_model("gemma3", tmp_path_factory.mktemp("gemma3")))
    assert model.spec.sliding_layers == (0, 2, 3) and model.spec.sliding_window == 8
    return model


def _ids(count: int, seed: int = 1) -> list[int]:
    return torch.randint(3, 128, (count,), generator=torch.Generator().manual_seed(seed)).tolist()


def _decode(model, cache, tokens, release: bool) -> list[torch.Tensor]:
    return [model.decode_step(token, cache, release_window_rows=release) for token in tokens]


def test_released_rows_change_no_logit_and_bound_the_windowed_layers(model):
    prompt, tokens = _ids(PROMPT), _ids(STEPS, seed=2)
    full, trimmed = model.new_cache(PROMPT + STEPS), model.new_cache(PROMPT + STEPS)
    model.prefill(torch.tensor(prompt), full)
    model.prefill(torch.tensor(prompt), trimmed)
    window, slack = 8, window_slack(8)
    held = []
    for token in tokens:
        expected = model.decode_step(token, full)
        logits = model.decode_step(token, trimmed, release_window_rows=True)
        torch.testing.assert_close(logits, expected, atol=1e-5, rtol=1e-5)
        held.append(trimmed.length - trimmed.first_row(0))
    assert trimmed.trimmed and max(held) <= window - 1 + slack and held[-1] >= window - 1
    assert [trimmed.first_row(layer) for layer in range(4)] == [
        trimmed.length - held[-1],
        0,
        *[trimmed.length - held[-1]] * 2,
    ]
    # one full layer holds every row; the three windowed ones at most window - 1 + slack
    row_bytes = model.spec.num_kv_heads * model.spec.head_dim * 4 * 2
    assert trimmed.nbytes <= row_bytes * (full.capacity + 3 * (window + slack))
    assert full.nbytes == row_bytes * 4 * full.capacity
    # the full layer's rows are those of the untrimmed cache
    keys, values = trimmed.layer(1)
    torch.testing.assert_close(keys, full.keys[1, :, : full.length], atol=0, rtol=0)
    for layer in (0, 2, 3):
        keys, values = trimmed.layer(layer)
        first = trimmed.first_row(layer)
        torch.testing.assert_close(values, full.values[layer, :, first : full.length], atol=0, rtol=0)


def test_a_batch_releases_only_its_dense_requests_rows_and_matches_one_by_one(model):
    caches = [model.new_cache(4), model.new_cache(4)]
    references = [model.new_cache(4), model.new_cache(4)]
    for seed, (cache, reference) in enumerate(zip(caches, references)):
        model.prefill(torch.tensor(_ids(PROMPT + 10 * seed, seed)), cache)
        model.prefill(torch.tensor(_ids(PROMPT + 10 * seed, seed)), reference)
    for token in _ids(40, seed=5):
        logits = model.decode_batch([token, token], caches, release_window_rows=True)
        expected = torch.stack([model.decode_step(token, reference) for reference in references])
        torch.testing.assert_close(logits, expected, atol=1e-5, rtol=1e-5)
    assert all(cache.trimmed for cache in caches)


def test_a_trimmed_cache_extends_copies_and_round_trips_but_refuses_a_cut_before_its_window(model):
    prompt, tokens, more = _ids(PROMPT), _ids(STEPS, seed=2), _ids(20, seed=3)
    full, trimmed = model.new_cache(8), model.new_cache(8)
    for cache, release in ((full, False), (trimmed, True)):
        model.prefill(torch.tensor(prompt), cache)
        _decode(model, cache, tokens, release)
    assert trimmed.trimmed
    with pytest.raises(ValueError, match="no all-layer keys"):
        _ = trimmed.keys
    with pytest.raises(ValueError, match="released rows"):
        trimmed.truncate(trimmed.earliest_cut - 1)
    with pytest.raises(ValueError, match="released rows"):
        trimmed.clone(rows=trimmed.earliest_cut - 1)

    context = Context("c", "t", "f", list(range(trimmed.length)), list(range(trimmed.length)), trimmed)
    stored = decode_context(encode_context(context)).cache
    copied = trimmed.clone(extra_capacity=4)
    cut = trimmed.clone(rows=trimmed.earliest_cut)
    reference_cut = full.clone(rows=trimmed.earliest_cut)
    assert stored.nbytes < full.nbytes and stored.first_row(0) == trimmed.first_row(0)
    # appending a prompt (a chat follow-up) to each equals appending it to the untrimmed cache
    expected = model.prefill(torch.tensor(more), full)
    for cache in (trimmed, stored, copied):
        torch.testing.assert_close(model.prefill(torch.tensor(more), cache), expected, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(
            model.decode_step(more[0], cache, release_window_rows=True),
            model.decode_step(more[0], full.clone()),
            atol=1e-5,
            rtol=1e-5,
        )
    torch.testing.assert_close(
        model.prefill(torch.tensor(more), cut), model.prefill(torch.tensor(more), reference_cut), atol=1e-5, rtol=1e-5
    )


def test_a_tail_restores_rows_the_turn_released(model):
    """A chat turn that fails gives its context back whole, even after its decode released
    windowed rows the context's next token would read."""
    prompt, tokens = _ids(PROMPT + 20), _ids(STEPS, seed=2)
    cache, reference = model.new_cache(8), model.new_cache(8)
    for each in (cache, reference):
        model.prefill(torch.tensor(prompt), each)
    kept = cache.length - 2
    tail = cache.tail(kept, window=8)
    cache.truncate(kept)
    _decode(model, cache, tokens, release=True)  # the failed turn
    assert cache.first_row(0) > kept
    cache.restore(tail)
    assert cache.length == reference.length
    token = _ids(1, seed=9)[0]
    torch.testing.assert_close(
        model.decode_step(token, cache), model.decode_step(token, reference), atol=1e-5, rtol=1e-5
    )
