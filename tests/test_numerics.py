"""Every numerics option against the float32 reference: weight formats, compute and cache
dtypes, their validation, and the fingerprint they feed."""

from __future__ import annotations

import pytest
import torch
from tiny_models import make_tiny_model

from ragkv.engine import EngineConfig
from ragkv.engine import numerics as numerics_module
from ragkv.engine.fingerprint import model_fingerprint
from ragkv.engine.linear import Int4Kernel, Int8Kernel
from ragkv.engine.model import CausalLM
from ragkv.engine.numerics import Numerics, resolve_numerics
from ragkv.kernels import cpu_extension

STEPS = 6

OPTIONS = {
    # name: (numerics, max relative logit error vs float32 over prefill + decode)
    "bfloat16": (Numerics("bfloat16", "bfloat16", "bfloat16", "bfloat16"), 0.03),
    "float16": (Numerics("float16", "float16", "float16", "float16"), 0.005),
    "float32-bf16-cache": (Numerics("float32", "bfloat16", "float32", "float32"), 0.01),
    "int8-decode": (Numerics("float32", "float32", "int8", "float32"), 0.03),
    "fast-cpu-mix": (Numerics("float32", "bfloat16", "int8", "bfloat16"), 0.03),
}


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_tiny_model("llama", tmp_path_factory.mktemp("llama"))


@pytest.fixture(scope="module")
def reference(folder):
    return CausalLM.load(folder)


def _run(model: CausalLM, tokens: list[int]) -> torch.Tensor:
    """Prefill logits followed by the logits of decoding `tokens`: [1 + len(tokens), vocab]."""
    prompt = torch.randint(3, 128, (40,), generator=torch.Generator().manual_seed(7))
    cache = model.new_cache(40 + len(tokens))
    rows = [model.prefill(prompt, cache)]
    rows += [model.decode_step(token, cache) for token in tokens]
    assert cache.keys.dtype == model.dtype
    return torch.stack(rows).float()


@pytest.mark.parametrize("option", sorted(OPTIONS))
def test_option_tracks_float32_reference(option, folder, reference):
    numerics, tolerance = OPTIONS[option]
    expected = _run(reference, list(range(10, 10 + STEPS)))
    got = _run(CausalLM.load(folder, numerics=numerics), list(range(10, 10 + STEPS)))
    relative = (got - expected).abs().max() / expected.abs().max()
    assert relative < tolerance, f"{option}: relative logit error {relative:.4f}"
    assert (got.argmax(-1) == expected.argmax(-1)).float().mean() >= 0.8


def test_batched_decode_in_the_fast_mix_equals_one_at_a_time(folder):
    model = CausalLM.load(folder, numerics=OPTIONS["fast-cpu-mix"][0])
    caches = [model.new_cache(64) for _ in range(3)]
    for seed, cache in enumerate(caches):
        model.prefill(torch.randint(3, 128, (10 + 7 * seed,), generator=torch.Generator().manual_seed(seed)), cache)
    clones = [cache.clone(extra_capacity=4) for cache in caches]
    batched = model.decode_batch([5, 6, 7], caches)
    alone = torch.stack([model.decode_step(token, cache) for token, cache in zip([5, 6, 7], clones)])
    torch.testing.assert_close(batched, alone, atol=1e-3, rtol=1e-3)


@pytest.mark.parametrize("kernel", [Int8Kernel, Int4Kernel])
def test_packed_kernels_match_their_dequantized_weights(kernel):
    weight = torch.randn(96, 128, generator=torch.Generator().manual_seed(0))
    x = torch.randn(3, 128, generator=torch.Generator().manual_seed(1))
    packed = kernel(weight)
    got = packed(x)
    assert got.dtype == x.dtype
    exact = x @ weight.t()
    # the quantization error bound: int8 ~1/254 of a row's range, int4 ~1/30 of a group's
    bound = 0.015 if kernel is Int8Kernel else 0.1
    assert (got - exact).abs().max() / exact.abs().max() < bound


def test_int4_rejects_columns_not_in_whole_groups():
    with pytest.raises(ValueError, match="divisible"):
        Int4Kernel(torch.randn(8, 40))


@pytest.mark.parametrize(
    "fields",
    [
        {"weights": "int5"},
        {"prefill_weights": "int8"},
        {"kv_cache_dtype": "float64"},
        {"weights": "int8", "device": "cuda"},
        {"dtype": "half"},
    ],
)
def test_invalid_options_fail_at_config_time(fields):
    with pytest.raises(ValueError):
        EngineConfig(**fields)


@pytest.mark.parametrize("bf16_units", [True, False])
def test_auto_picks_by_cpu_capability(monkeypatch, bf16_units):
    monkeypatch.setattr(numerics_module, "cpu_has_bf16_units", lambda: bf16_units)
    resolved = resolve_numerics("float32", "auto", "auto", "auto", "cpu")
    # int4 decode weights run the compiled kernel; without it torch's int8 kernel
    weights = "int4" if cpu_extension.buildable() else "int8"
    if bf16_units:
        assert resolved == Numerics("float32", "bfloat16", weights, "bfloat16")
    else:
        # no bf16 GEMMs; the cache is bf16 only where the compiled kernels read it natively
        kv = "bfloat16" if cpu_extension.buildable() else "float32"
        assert resolved == Numerics("float32", kv, weights, "float32")
    assert resolve_numerics("float32", "float16", "int4", "float32", "cpu").weights == "int4"


def test_auto_keeps_int8_without_the_compiled_kernels(monkeypatch):
    monkeypatch.setattr(cpu_extension, "buildable", lambda: False)
    assert resolve_numerics("float32", "auto", "auto", "auto", "cpu").weights == "int8"


def test_fingerprint_changes_with_numerics(folder, reference):
    def fingerprint(numerics: Numerics) -> str:
        return model_fingerprint(folder, reference.spec, "float16", [1, 2], numerics)

    seen = {fingerprint(numerics) for numerics, _ in OPTIONS.values()}
    assert len(seen) == len(OPTIONS)
    assert fingerprint(Numerics.uniform(torch.float32)) not in seen


@pytest.mark.parametrize("native", [True, False])
def test_attention_widens_16_bit_caches_where_the_cpu_would_emulate_them(monkeypatch, native):
    monkeypatch.setattr(numerics_module, "cpu_has_bf16_units", lambda: native)
    cpu = torch.device("cpu")
    assert numerics_module.attention_compute_dtype(torch.bfloat16, cpu) == (torch.bfloat16 if native else torch.float32)
    assert numerics_module.attention_compute_dtype(torch.float32, cpu) == torch.float32
