"""Every fusion strategy in every compute dtype (float32, bfloat16, float16), on a tiny
random Llama so float16 (which this CPU only emulates, ~100x slower than float32) stays
fast. The reference is the plain prefill in the same dtype."""

from __future__ import annotations

import pytest
import torch
from fusion_cases import fusion_case
from tiny_models import make_tiny_model

from ragkv.engine.model import CausalLM
from ragkv.fusion import STRATEGY_NAMES, build_strategy
from ragkv.fusion.fidelity import next_token_kl

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# KL(plain prefill || fusion with every row recomputed): the same arithmetic through other
# kernels (selective vs causal attention), so only the dtype's rounding may differ.
EXACT_KL = {"float32": 1e-7, "bfloat16": 2e-3, "float16": 2e-4}


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_tiny_model("llama", tmp_path_factory.mktemp("llama"))


@pytest.fixture(scope="module", params=sorted(DTYPES))
def case(request, folder):
    """(model, fusion input, plain-prefill logits, dtype name)."""
    model = CausalLM.load(folder, DTYPES[request.param])
    fusion_input, prefix_cache, reference = fusion_case(model, vocab=128)
    return model, fusion_input, prefix_cache, reference, request.param


@pytest.mark.parametrize("name", STRATEGY_NAMES)
def test_every_strategy_fuses_in_the_model_dtype(case, name):
    model, fusion_input, prefix_cache, reference, _ = case
    result = build_strategy(name).fuse(model, fusion_input, prefix_cache, extra_capacity=4)
    assert result.cache.keys.dtype == result.cache.values.dtype == model.dtype
    assert result.logits.shape == reference.shape and torch.isfinite(result.logits).all()
    token = int(result.logits.argmax())
    assert torch.isfinite(model.decode_step(token, result.cache)).all()


@pytest.mark.parametrize(
    "spec",
    [
        "full",
        "a3:ratio=1",
        "cacheblend:ratio=1",
        "a3:ratio=1,check_layer=2,head_aggregation=max",
        "a3:ratio=1,deviation_share=0,exclude_sinks=true,query_tokens=text",
    ],
)
def test_recomputing_every_row_equals_the_full_prefill(case, spec):
    model, fusion_input, prefix_cache, reference, dtype = case
    result = build_strategy(spec).fuse(model, fusion_input, prefix_cache)
    assert next_token_kl(reference, result.logits) < EXACT_KL[dtype]


def test_partial_recompute_lies_between_reuse_and_full(case):
    model, fusion_input, prefix_cache, reference, dtype = case
    kls = [
        next_token_kl(reference, build_strategy(f"a3:ratio={r}").fuse(model, fusion_input, prefix_cache).logits)
        for r in (0.0, 1.0)
    ]
    assert kls[1] < EXACT_KL[dtype] < kls[0]
