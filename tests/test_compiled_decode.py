"""The compiled decode step against its reference, the Python forward loop, on tiny random
Llama checkpoints with int8 or int4 decode weights: same greedy tokens, close logits, same
cache rows; and the models it does not cover. Batched against one request at a time:
tests/test_decode_batch.py. The int4 kernel itself against its torch reference:
tests/test_int4_linear.py."""

from __future__ import annotations

from dataclasses import fields

import pytest
import torch
from compiled_kernels import SKIP_REASON, run_compiled_tests  # tests/ is on sys.path
from tiny_models import make_tiny_model

from ragkv.engine.compiled_decode import COMPILED_PREFILL_ROWS, unsupported_reason
from ragkv.engine.decode_weights import DecodeLayerWeights, PackedWeight
from ragkv.engine.model import CausalLM
from ragkv.engine.numerics import Numerics
from ragkv.kernels import cpu_extension

pytestmark = pytest.mark.skipif(not run_compiled_tests(), reason=SKIP_REASON)

PROMPT_LENGTHS = (5, 300, 31, 9)
STEPS = 10


class Case:
    def __init__(self, folder, weights: str):
        self.folder, self.weights = folder, weights


@pytest.fixture(
    scope="module",
    params=[("llama", "int8"), ("llama3-rope", "int8"), ("llama-int4", "int4")],
    ids=lambda param: "-".join(param),
)
def folder(request, tmp_path_factory):
    family, weights = request.param
    return Case(make_tiny_model(family, tmp_path_factory.mktemp(family)), weights)


def _load(case: Case, kv: str, compiled: bool) -> CausalLM:
    numerics = Numerics(dtype="float32", kv_cache_dtype=kv, weights=case.weights, prefill_weights="float32")
    model = CausalLM.load(case.folder, numerics=numerics)
    model.compiled_decode = compiled
    assert (model.compiled_decoder() is not None) == compiled
    return model


def _prefilled(model: CausalLM):
    caches, logits = [], []
    for seed, length in enumerate(PROMPT_LENGTHS):
        prompt = torch.randint(3, 128, (length,), generator=torch.Generator().manual_seed(seed))
        cache = model.new_cache(length + STEPS)
        logits.append(model.prefill(prompt, cache))
        caches.append(cache)
    return caches, torch.stack(logits)


TIE = 0.02
"""The Python loop's logits come out of a bf16 LM head (steps of 2^-7 near 1): two tokens
within this of its best are a tie that either loop may break its own way."""


def assert_same_greedy_choice(compiled_logits: torch.Tensor, python_logits: torch.Tensor) -> None:
    chosen = compiled_logits.argmax(-1, keepdim=True)
    shortfall = python_logits.max(-1).values - python_logits.gather(-1, chosen).squeeze(-1)
    assert (shortfall <= TIE).all(), (
        f"the compiled step chose tokens the Python loop ranks {shortfall.tolist()} below its best"
    )


@pytest.mark.parametrize("kv", ["float32", "bfloat16"])
def test_compiled_step_follows_the_python_loop(folder, kv):
    python, compiled = _load(folder, kv, False), _load(folder, kv, True)
    python_caches, python_logits = _prefilled(python)
    compiled_caches, compiled_logits = _prefilled(compiled)
    for _ in range(STEPS):
        tokens = python_logits.argmax(-1).tolist()
        assert_same_greedy_choice(compiled_logits, python_logits)
        python_logits = python.decode_batch(tokens, python_caches)
        compiled_logits = compiled.decode_batch(tokens, compiled_caches)
        # the Python loop rounds q, attention outputs and packed-kernel activations to
        # bf16; the compiled step keeps them in float32
        torch.testing.assert_close(compiled_logits, python_logits, atol=0.15, rtol=0.02)
    for alone, batched in zip(python_caches, compiled_caches):
        assert batched.length == alone.length and batched.next_position == alone.next_position
        rows = alone.length
        for name in ("keys", "values"):
            torch.testing.assert_close(
                getattr(batched, name)[:, :, :rows].float(),
                getattr(alone, name)[:, :, :rows].float(),
                atol=0.05,
                rtol=0.02,
            )


def test_compiled_step_is_closer_to_float32_than_the_python_int8_loop(folder):
    """Keeping activations in float32 must not cost accuracy against float32 weights (int4
    runs the same compiled linears in both loops)."""
    if folder.weights != "int8":
        pytest.skip("the Python loop's int4 linears are the compiled kernel")
    reference = CausalLM.load(folder.folder, numerics=Numerics.uniform(torch.float32))
    reference_caches, reference_logits = _prefilled(reference)
    errors = {}
    for compiled in (False, True):
        model = _load(folder, "float32", compiled)
        caches, _ = _prefilled(model)
        tokens = reference_logits.argmax(-1).tolist()
        errors[compiled] = (
            (
                model.decode_batch(tokens, caches)
                - reference.decode_batch(tokens, [c.clone(2) for c in reference_caches])
            )
            .abs()
            .max()
        )
    assert errors[True] <= errors[False] * 1.05


@pytest.mark.parametrize("kv", ["float32", "bfloat16"])
@pytest.mark.parametrize("new_tokens", [1, 7, 16, 32])
def test_a_short_prefill_after_a_prefix_follows_the_python_loop(folder, kv, new_tokens):
    """A chat turn's new tokens go through the compiled step: each token attends causally
    to the prefix and the new tokens before it."""
    python, compiled = _load(folder, kv, False), _load(folder, kv, True)
    prefix = torch.randint(3, 128, (200,), generator=torch.Generator().manual_seed(1))
    turn = torch.randint(3, 128, (new_tokens,), generator=torch.Generator().manual_seed(2))
    results = []
    for model in (python, compiled):
        cache = model.new_cache(8)
        model.prefill(prefix, cache)
        results.append((model.prefill(turn, cache), cache))
    (python_logits, python_cache), (compiled_logits, compiled_cache) = results
    assert compiled_cache.length == compiled_cache.next_position == 200 + new_tokens
    torch.testing.assert_close(compiled_logits, python_logits, atol=0.15, rtol=0.02)
    for name in ("keys", "values"):
        torch.testing.assert_close(
            getattr(compiled_cache, name)[:, :, : 200 + new_tokens].float(),
            getattr(python_cache, name)[:, :, : 200 + new_tokens].float(),
            atol=0.05,
            rtol=0.02,
        )


def test_a_long_or_first_prefill_keeps_the_python_loop(folder, monkeypatch):
    model = _load(folder, "float32", True)
    monkeypatch.setattr(type(model.compiled_decoder()), "extend", lambda *args: pytest.fail("compiled prefill"))
    cache = model.new_cache(8)
    model.prefill(torch.arange(3, 13), cache)
    model.prefill(torch.arange(3, 3 + COMPILED_PREFILL_ROWS + 1), cache)
    assert cache.length == 10 + COMPILED_PREFILL_ROWS + 1


@pytest.mark.parametrize(
    "family,numerics,reason",
    [
        ("llama", Numerics.uniform(torch.float32), "int8"),
        ("qwen2", Numerics("float32", "float32", "int8", "float32"), "bias"),
        ("qwen3", Numerics("float32", "float32", "int8", "float32"), "bias"),
        ("llama", Numerics("float32", "float16", "int8", "float32"), "cache"),
    ],
)
def test_models_it_does_not_cover_keep_the_python_loop(tmp_path, family, numerics, reason):
    model = CausalLM.load(make_tiny_model(family, tmp_path), numerics=numerics)
    assert reason in unsupported_reason(model.spec, model.weights, model.numerics, model.device)
    assert model.compiled_decoder() is None
    cache = model.new_cache(8)
    model.prefill(torch.tensor([3, 4, 5]), cache)
    assert model.decode_step(6, cache).shape == (model.spec.vocab_size,)


@pytest.mark.parametrize("python_type", [PackedWeight, DecodeLayerWeights], ids=lambda t: t.__name__)
def test_the_weight_structs_mirror_the_compiled_ones_field_for_field(python_type):
    """The layers cross into C++ by name: every field of the Python mirror is an attribute
    of the bound struct, and the struct has no other."""
    compiled_type = getattr(cpu_extension.load(), python_type.__name__)
    bound = {name for name in dir(compiled_type) if not name.startswith("_")}
    assert bound == {field.name for field in fields(python_type)}
