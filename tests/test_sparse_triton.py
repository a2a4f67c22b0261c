"""The selectors through the Triton kernels (CPU interpreter) agree with the torch reference:
checks that the views they hand the kernels (int16 code slices, expanded index rows) are
valid kernel inputs, not just valid torch inputs."""

import os

# Must precede any triton import (see tests/test_kernels_sparse_attention.py).
os.environ["TRITON_INTERPRET"] = "1"

import pytest
import torch

from kernels.dispatch import importable
from ragkv.sparse import PromptState, SparseConfig
from ragkv.sparse.calibrate import CalibrationConfig, calibrate
from test_sparse_support import tiny_model

pytestmark = pytest.mark.skipif(not importable("triton"), reason="triton is not installed")
ROWS = 160


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    model = tiny_model(tmp_path_factory.mktemp("tiny-llama-triton"), layers=1)
    config = CalibrationConfig(codebook_size=16, tokens=256, sequence_tokens=128, iterations=2)
    codebook = calibrate(model, lambda s: [b % 500 + 3 for b in s.encode()], ["some calibration text " * 20], [], config)
    ids = torch.randint(3, 500, (ROWS,), generator=torch.Generator().manual_seed(0))
    cache = model.new_cache(ROWS + 4)
    model.prefill(ids, cache)
    return model, codebook, ids, cache


@pytest.mark.parametrize("selector,aggregation", [("a2ats", "logits"), ("pqcache", "logits"), ("lrqk", "probs"), ("oracle", "probs")])
def test_triton_backend_matches_torch(setup, selector, aggregation):
    model, codebook, ids, cache = setup
    q = torch.randn(model.spec.num_heads, 1, model.spec.head_dim, generator=torch.Generator().manual_seed(1))
    outputs, chosen = {}, {}
    for backend in ("torch", "triton"):
        config = SparseConfig(selector=selector, budget=48, sinks=2, window=8, backend=backend,
                              head_aggregation=aggregation, a2ats_mean_key=False)
        attention = config.build(PromptState.from_prefill(model, cache.clone(), ids, 2, ROWS - 8), codebook)
        attention.observer = lambda layer, q_, c, indices, start, end, b=backend: chosen.update({b: indices})
        outputs[backend] = attention(0, q, cache, model.scale)
    for head in range(model.spec.num_kv_heads):
        assert set(chosen["torch"][head].tolist()) == set(chosen["triton"][head].tolist())
    torch.testing.assert_close(outputs["triton"], outputs["torch"], atol=1e-5, rtol=1e-5)
