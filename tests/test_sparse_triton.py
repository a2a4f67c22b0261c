"""The selectors through the Triton kernels (CPU interpreter) agree with the torch reference:
checks that the views they hand the kernels (int16 code slices, expanded index rows) are
valid kernel inputs, not just valid torch inputs.

The interpreter must be chosen before triton.language is first imported, which another
test module (anything importing transformers) may already have done in this pytest
process, so the comparison runs in a fresh interpreter with TRITON_INTERPRET=1.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from ragkv.kernels.dispatch import importable

ROWS = 160
CASES = (("a2ats", "logits"), ("pqcache", "logits"), ("lrqk", "probs"), ("oracle", "probs"))


def compare_backends() -> None:
    import torch
    from tiny_models import make_tiny_model

    from ragkv.engine.model import CausalLM
    from ragkv.sparse import PromptState, SparseConfig
    from ragkv.sparse.calibrate import CalibrationConfig, calibrate

    model = CausalLM.load(make_tiny_model("llama-sparse", Path(tempfile.mkdtemp()), num_hidden_layers=1))
    config = CalibrationConfig(codebook_size=16, tokens=256, sequence_tokens=128, iterations=2)
    codebook = calibrate(
        model, lambda s: [b % 500 + 3 for b in s.encode()], ["some calibration text " * 20], [], config
    )
    ids = torch.randint(3, 500, (ROWS,), generator=torch.Generator().manual_seed(0))
    cache = model.new_cache(ROWS + 4)
    model.prefill(ids, cache)
    q = torch.randn(model.spec.num_heads, 1, model.spec.head_dim, generator=torch.Generator().manual_seed(1))
    for selector, aggregation in CASES:
        outputs, chosen = {}, {}
        for backend in ("torch", "triton"):
            spec = selector + ":mean_key=false" if selector == "a2ats" else selector
            sparse = SparseConfig(
                selector=spec, budget=48, sinks=2, window=8, backend=backend, head_aggregation=aggregation
            )
            attention = sparse.build(PromptState.from_prefill(model, cache.clone(), ids, 2, ROWS - 8), codebook)
            attention.observer = lambda layer, q_, c, indices, start, end, b=backend: chosen.update({b: indices})
            outputs[backend] = attention(0, q, cache, model.scale)
        for head in range(model.spec.num_kv_heads):
            assert set(chosen["torch"][head].tolist()) == set(chosen["triton"][head].tolist()), selector
        torch.testing.assert_close(outputs["triton"], outputs["torch"], atol=1e-5, rtol=1e-5)
        print(f"{selector} ok")


@pytest.mark.skipif(not importable("triton"), reason="triton is not installed")
def test_triton_backend_matches_torch():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    result = subprocess.run([sys.executable, __file__], capture_output=True, text=True, env=env, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count(" ok") == len(CASES)


if __name__ == "__main__":
    compare_backends()
