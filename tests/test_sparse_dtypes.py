"""Every selector decodes in float32, bfloat16 and float16: a budget that covers every row
is dense decode of the same dtype, and a sparse step is exact attention over the rows it
chose (the float32 reference of kernels.sparse_decode_attention), per-dtype tolerances."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from sparse_cases import full_budget_and_dense
from tiny_models import make_tiny_model

from ragkv.engine.model import CausalLM
from ragkv.kernels import reference
from ragkv.sparse import PromptState, SparseConfig, selector_names
from ragkv.sparse.calibrate import CalibrationConfig, calibrate
from ragkv.sparse.oracle import attention_mass

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
TOLERANCE = {
    torch.float32: dict(atol=1e-4, rtol=1e-4),
    torch.bfloat16: dict(atol=3e-2, rtol=3e-2),
    torch.float16: dict(atol=3e-3, rtol=3e-3),
}
LOGIT_TOLERANCE = {  # logits after every layer: attention rounding in 16 bits compounds
    torch.float32: dict(atol=1e-4, rtol=1e-4),
    torch.bfloat16: dict(atol=0.2, rtol=0.05),
    torch.float16: dict(atol=0.04, rtol=0.01),
}
ROWS = 200


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_tiny_model("llama-sparse", tmp_path_factory.mktemp("tiny-llama-dtypes"))


@pytest.fixture(scope="module")
def codebook(folder):
    """Calibrated once in float32: a codebook is float32 whatever the model's dtype."""
    model = CausalLM.load(folder)
    config = CalibrationConfig(codebook_size=16, tokens=512, sequence_tokens=256, iterations=3)
    return calibrate(
        model, lambda s: [b % 500 + 3 for b in s.encode()], ["a calibration text, repeated " * 30], [5], config
    )


@pytest.fixture(scope="module", params=DTYPES, ids=lambda dtype: str(dtype).split(".")[-1])
def model(request, folder):
    return CausalLM.load(folder, dtype=request.param)


def prompt_cache(model):
    ids = torch.randint(3, 500, (ROWS,), generator=torch.Generator().manual_seed(4))
    cache = model.new_cache(ROWS + 8)
    logits = model.prefill(ids, cache)
    return ids, cache, logits


@pytest.mark.parametrize("selector", selector_names())
def test_full_budget_is_dense_decode_of_the_same_dtype(model, codebook, selector):
    ids, _, _ = prompt_cache(model)
    for sparse, dense in full_budget_and_dense(model, ids, codebook, selector):
        assert sparse.dtype == dense.dtype
        torch.testing.assert_close(sparse.float(), dense.float(), **LOGIT_TOLERANCE[model.dtype])
        assert int(sparse.argmax()) == int(dense.argmax())


@pytest.mark.parametrize("selector", [name for name in selector_names() if name != "dense"])
def test_sparse_step_is_exact_attention_over_the_chosen_rows(model, codebook, selector):
    ids, cache, _ = prompt_cache(model)
    attention = SparseConfig(selector=selector, budget=32, sinks=2, window=6).build(
        PromptState.from_prefill(model, cache, ids, 2, ROWS - 8), codebook
    )
    seen = {}
    attention.observer = lambda layer, q, c, indices, start, end: seen.update(indices=indices)
    q = torch.randn(model.spec.num_heads, 1, model.spec.head_dim, generator=torch.Generator().manual_seed(0)).to(
        model.dtype
    )
    out = attention(1, q, cache, model.scale)
    assert out.dtype == model.dtype and out.shape == q.shape and torch.isfinite(out.float()).all()
    keys, values = cache.layer(1)
    indices = seen["indices"]
    assert indices.shape == (model.spec.num_kv_heads, 32)
    expected, _ = reference.sparse_decode_attention(q[:, 0], keys, values, indices, model.scale, None)
    torch.testing.assert_close(out[:, 0].float(), expected.float(), **TOLERANCE[model.dtype])
    if selector == "oracle":  # exact scores: the rows carrying the most mass, in every dtype
        mass = attention_mass(q, keys, model.scale)[:, 2 : ROWS - 6]
        best = mass.topk(32 - 8, dim=-1).values.sum(-1)
        chosen = torch.gather(mass, 1, indices[:, 2:-6] - 2).sum(-1)
        torch.testing.assert_close(chosen, best, atol=1e-5, rtol=1e-5)


def test_dense_sdpa_reference_agrees_across_dtypes(folder):
    """The dense reference itself: 16-bit decode attention stays close to float32's."""
    q = torch.randn(4, 1, 16, generator=torch.Generator().manual_seed(1))
    keys = torch.randn(2, 50, 16, generator=torch.Generator().manual_seed(2))
    exact = F.scaled_dot_product_attention(q, keys, keys, enable_gqa=True)
    for dtype in (torch.bfloat16, torch.float16):
        low = F.scaled_dot_product_attention(q.to(dtype), keys.to(dtype), keys.to(dtype), enable_gqa=True)
        torch.testing.assert_close(low.float(), exact, **TOLERANCE[dtype])


def test_flashinfer_backend_refuses_float32_at_build(folder, codebook):
    model = CausalLM.load(folder)
    ids, cache, _ = prompt_cache(model)
    with pytest.raises(ValueError, match="flashinfer backend decodes float16/bfloat16"):
        SparseConfig(selector="oracle", backend="flashinfer").build(
            PromptState.from_prefill(model, cache, ids, 2, ROWS - 8)
        )
