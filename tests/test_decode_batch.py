"""Batched decode against one-at-a-time decode: same tokens, same logits, same caches."""

from __future__ import annotations

import pytest
import torch
from compiled_kernels import SKIP_REASON, run_compiled_tests  # tests/ is on sys.path
from tiny_models import make_tiny_model

from ragkv.engine.model import CausalLM
from ragkv.engine.numerics import Numerics

PROMPT_LENGTHS = (5, 17, 31, 9)
STEPS = 12


@pytest.fixture(scope="module", params=["python-loop", "compiled-step"])
def model(request, tmp_path_factory) -> CausalLM:
    """The float32 Python loop, and int8 weights over a bf16 cache, which run the compiled
    decode step where it builds (ragkv.engine.compiled_decode)."""
    folder = make_tiny_model("llama", tmp_path_factory.mktemp("llama"))
    if request.param == "python-loop":
        return CausalLM.load(folder)
    if not run_compiled_tests():
        pytest.skip(SKIP_REASON)
    model = CausalLM.load(folder, numerics=Numerics("float32", "bfloat16", "int8", "float32"))
    assert model.compiled_decoder() is not None
    return model


def _prompt(length: int, seed: int) -> torch.Tensor:
    return torch.randint(3, 128, (length,), generator=torch.Generator().manual_seed(seed))


def _prefilled(model: CausalLM):
    caches, logits = [], []
    for seed, length in enumerate(PROMPT_LENGTHS):
        cache = model.new_cache(length + STEPS)
        logits.append(model.prefill(_prompt(length, seed), cache))
        caches.append(cache)
    return caches, torch.stack(logits)


def test_batched_greedy_decode_equals_one_at_a_time(model):
    alone_caches, alone_logits = _prefilled(model)
    batch_caches, batch_logits = _prefilled(model)
    for _ in range(STEPS):
        tokens = batch_logits.argmax(-1).tolist()
        assert tokens == alone_logits.argmax(-1).tolist()
        alone_logits = torch.stack([model.decode_step(t, c) for t, c in zip(tokens, alone_caches)])
        batch_logits = model.decode_batch(tokens, batch_caches)
        torch.testing.assert_close(batch_logits, alone_logits, atol=1e-4, rtol=1e-4)
    for alone, batched, length in zip(alone_caches, batch_caches, PROMPT_LENGTHS):
        assert batched.length == alone.length == length + STEPS
        assert batched.next_position == alone.next_position
        torch.testing.assert_close(batched.keys[:, :, : batched.length], alone.keys[:, :, : alone.length])


def test_batch_rows_use_their_own_sparse_attention(model):
    calls: list[int] = []

    def counting(index):
        def attention(layer, q, cache, scale):
            calls.append(index)
            keys, values = cache.layer(layer)
            return torch.nn.functional.scaled_dot_product_attention(
                q[None].float(), keys[None].float(), values[None].float(), scale=scale, enable_gqa=True
            )[0].to(q.dtype)

        return attention

    caches, logits = _prefilled(model)
    reference_caches, reference = _prefilled(model)
    tokens = logits.argmax(-1).tolist()
    got = model.decode_batch(tokens, caches, [counting(0), None, counting(2), None])
    # a batch with sparse rows runs the Python loop: compare with the Python loop's dense step
    compiled, model.compiled_decode = model.compiled_decode, False
    try:
        expected = model.decode_batch(tokens, reference_caches)
    finally:
        model.compiled_decode = compiled
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    assert calls.count(0) == calls.count(2) == model.spec.num_layers and len(calls) == 2 * model.spec.num_layers


def test_mismatched_batch_is_rejected(model):
    caches, _ = _prefilled(model)
    with pytest.raises(ValueError):
        model.decode_batch([3, 4], caches)
    with pytest.raises(ValueError):
        model.decode_batch([3, 4], [caches[0], caches[0]])
