"""The own forward loop against transformers: logits and greedy generation, per family."""

from __future__ import annotations

import pytest
import torch
from tiny_models import CONFIGS, make_tiny_model
from transformers import AutoModelForCausalLM

from ragkv.engine.model import CausalLM


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def tiny(request, tmp_path_factory):
    folder = make_tiny_model(request.param, tmp_path_factory.mktemp(request.param))
    reference = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    return CausalLM.load(folder), reference


def _prompt(length: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(3, 128, (length,), generator=torch.Generator().manual_seed(seed))


def test_prefill_logits_match_transformers(tiny):
    model, reference = tiny
    tokens = _prompt(40)
    cache = model.new_cache(40)
    ours = model.prefill(tokens, cache)
    with torch.no_grad():
        theirs = reference(tokens[None]).logits[0, -1]
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)


def test_prefill_after_cached_prefix_matches_one_prefill(tiny):
    model, _ = tiny
    tokens = _prompt(50)
    whole = model.new_cache(50)
    expected = model.prefill(tokens, whole)
    split = model.new_cache(20)
    model.prefill(tokens[:20], split)
    got = model.prefill(tokens[20:], split)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(split.keys[:, :, :50], whole.keys[:, :, :50], atol=1e-5, rtol=1e-5)


def test_greedy_generation_matches_transformers_generate(tiny):
    model, reference = tiny
    tokens = _prompt(24, seed=2)
    cache = model.new_cache(64)
    logits = model.prefill(tokens, cache)
    ours = []
    for _ in range(20):
        token = int(logits.argmax())
        ours.append(token)
        logits = model.decode_step(token, cache)
    with torch.no_grad():
        theirs = reference.generate(tokens[None], max_new_tokens=20, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert ours == theirs[0, tokens.numel() :].tolist()


def test_chunk_kv_keys_are_pre_rope(tiny):
    model, _ = tiny
    tokens = _prompt(30, seed=3)
    cache = model.new_cache(30)
    model.prefill(tokens, cache)
    keys, values = model.chunk_kv(tokens)
    for layer in range(model.spec.num_layers):
        rotated = model.rotary_of(layer).rotate(keys[layer], torch.arange(30))
        torch.testing.assert_close(rotated, cache.keys[layer, :, :30], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(values[layer], cache.values[layer, :, :30], atol=1e-5, rtol=1e-5)
