"""The engine's forward loop, every fusion strategy and every sparse selector on a CUDA GPU
(skipped without one): a tiny random Llama on the GPU against the same checkpoint on the
CPU, in every dtype. The forward loop is no further from float32 than the CPU's; every
strategy fuses, and recomputing every row is the full prefill; each selector at a budget
covering every row equals dense decode, and at a small budget it is exact attention over
the rows it chose. Runs in a fresh interpreter without
TRITON_INTERPRET (conftest sets it), so the Triton kernels run compiled; every failure is
reported, not only the first."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path

import pytest
import torch

from ragkv.bench.kernel_bench import relative_error
from ragkv.kernels.dispatch import importable

ROWS = 200
# ||a - b|| / ||b||, about twice what the same checks give on the CPU: 16-bit rounding
# compounds over the layers (bfloat16 keeps 8 bits)
FULL_BUDGET_TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 5e-2, torch.float16: 1e-2}  # against dense, same dtype
OUT_TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}  # against exact attention
RECOMPUTE_EVERY_ROW = ["a3:ratio=1", "cacheblend:ratio=1"]


def teacher_forced(model, ids: torch.Tensor, tokens: list[int] | None = None, steps: int = 6) -> list[torch.Tensor]:
    """The prefill's logits, then each decode step's, fed `tokens` (or its own greedy choices)."""
    cache = model.new_cache(ids.numel() + steps + 8)
    logits = [model.prefill(ids, cache)]
    for step in range(steps):
        logits.append(model.decode_step(tokens[step] if tokens else int(logits[-1].argmax()), cache))
    return logits


def fused_kl(model, spec: str) -> float:
    """KL(full prefill || fused) of the first answer token (tiny_models.fusion_case); also
    checks that the fused cache decodes."""
    from fusion_cases import fusion_case

    from ragkv.fusion import build_strategy
    from ragkv.fusion.fidelity import next_token_kl

    fusion_input, prefix_cache, full = fusion_case(model, vocab=500)
    fused = build_strategy(spec).fuse(model, fusion_input, prefix_cache, extra_capacity=4)
    assert fused.cache.keys.dtype == model.dtype and torch.isfinite(fused.logits.float()).all()
    assert torch.isfinite(model.decode_step(int(fused.logits.argmax()), fused.cache).float()).all()
    return float(next_token_kl(full.float().cpu(), fused.logits.float().cpu()))


def stored_fusion(folder: Path, device: str, dtype: str = "bfloat16") -> tuple[float, torch.Tensor]:
    """The product path on `device`: an Engine (`dtype` formats) encodes chunks, they go
    through the store's blob format in host memory and come back as int4 codes, are fused
    with the default strategy (returned: its first-token KL to the full prefill) and placed
    without recompute (returned: those logits, on the CPU)."""
    from ragkv.engine import Engine, EngineConfig
    from ragkv.fusion import DEFAULT_STRATEGY, FusionInput, LoadedChunk, build_strategy
    from ragkv.fusion.fidelity import next_token_kl
    from ragkv.store.blob import decode_blob, encode_blob

    formats = dict(weights=dtype, prefill_weights=dtype, kv_cache_dtype=dtype, kv_storage="int4")
    engine = Engine(EngineConfig(model=str(folder), device=device, **formats))
    generator = torch.Generator().manual_seed(5)
    chunk_ids = [torch.randint(3, 500, (48,), generator=generator).tolist() for _ in range(4)]
    question = torch.randint(3, 500, (10,), generator=generator).tolist()
    chunks = []
    for ids in chunk_ids:
        tensors = engine.encode_chunk(ids)
        assert all(not t.is_cuda for t in tensors.values()), "the store's tensors must be in host memory"
        stored = decode_blob(encode_blob(tensors)).tensors
        chunks.append(LoadedChunk(ids, *engine.kv_format.unpack(stored)))
    prefix = list(engine.chunk_prefix_ids)
    fusion_input = FusionInput(prefix, chunks, question, chunk_precompute_offset=len(prefix))
    fused = build_strategy(DEFAULT_STRATEGY).fuse(engine.model, fusion_input, engine.chunk_prefix_cache(), 4)
    _, full = engine.prefill(prefix + sum(chunk_ids, []) + question)
    assert fused.logits.device.type == torch.device(device).type
    assert torch.isfinite(engine.model.decode_step(int(fused.logits.argmax()), fused.cache).float()).all()
    placed = build_strategy("full_reuse").fuse(engine.model, fusion_input, engine.chunk_prefix_cache())
    return float(next_token_kl(full.float().cpu(), fused.logits.float().cpu())), placed.logits.float().cpu()


def check_on_gpu() -> list[str]:
    sys.path.insert(0, str(Path(__file__).parent))
    from sparse_cases import full_budget_and_dense
    from tiny_models import make_tiny_model

    from ragkv.engine.model import CausalLM
    from ragkv.fusion import STRATEGY_NAMES
    from ragkv.kernels import reference
    from ragkv.sparse import PromptState, SparseConfig, selector_names
    from ragkv.sparse.calibrate import CalibrationConfig, calibrate

    failures: list[str] = []

    def check(name, fn):
        try:
            fn()
        except Exception:  # every failure is collected and reported together
            failures.append(f"{name}:\n{traceback.format_exc(limit=6)}")

    folder = make_tiny_model(
        "llama-sparse",
        Path(tempfile.mkdtemp()),
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=64,
        hidden_size=256,
    )
    cpu = CausalLM.load(folder)
    codebook = calibrate(
        cpu,
        lambda s: [b % 500 + 3 for b in s.encode()],
        ["a calibration text, repeated " * 30],
        [5],
        CalibrationConfig(codebook_size=16, tokens=512, sequence_tokens=256, iterations=3),
    )
    ids = torch.randint(3, 500, (ROWS,), generator=torch.Generator().manual_seed(4))
    reference_logits = teacher_forced(cpu, ids)
    greedy = [int(logits.argmax()) for logits in reference_logits]

    def engine_on_gpu():
        # the same formats on the CPU set the bound: the device changes summation order only
        with_tokenizer = make_tiny_model(
            "llama-sparse",
            Path(tempfile.mkdtemp()),
            tokenizer=True,
            num_attention_heads=8,
            num_key_value_heads=2,
            head_dim=64,
            hidden_size=256,
        )
        (kl, placed), (cpu_kl, cpu_placed) = stored_fusion(with_tokenizer, "cuda"), stored_fusion(with_tokenizer, "cpu")
        _, reference_placed = stored_fusion(with_tokenizer, "cpu", "float32")
        error, cpu_error = relative_error(placed, reference_placed), relative_error(cpu_placed, reference_placed)
        assert error <= 2 * cpu_error + 1e-4, f"stored chunks placed: {error} from float32, the CPU's {cpu_error}"
        assert kl <= 2 * cpu_kl + 1e-3, f"stored chunks fused on the GPU: KL {kl}, on the CPU {cpu_kl}"
        print(
            f"engine on cuda: stored int4 chunks placed {error:.1e} ({cpu_error:.1e}), fused KL {kl:.1e} ({cpu_kl:.1e})"
        )

    check("engine on cuda", engine_on_gpu)

    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        gpu = CausalLM.load(folder, dtype=dtype, device="cuda")

        def forward_loop():
            # no further from float32 than twice the CPU's own forward loop in this dtype (float32:
            # other summation orders, 1e-5 measured on an H100)
            cpu_errors = [
                relative_error(logits, expected)
                for logits, expected in zip(
                    teacher_forced(CausalLM.load(folder, dtype=dtype), ids, greedy), reference_logits
                )
            ]
            gpu_logits = teacher_forced(gpu, ids, greedy)
            for step, (logits, expected) in enumerate(zip(gpu_logits, reference_logits)):
                assert logits.is_cuda and torch.isfinite(logits.float()).all()
                error, bound = relative_error(logits, expected), 2 * cpu_errors[step] + 1e-4
                assert error <= bound, f"step {step}: logits differ by {error}, the CPU's by {cpu_errors[step]}"
                print(f"{dtype} forward step {step}: {error:.1e} (CPU {cpu_errors[step]:.1e})")

        check(f"{dtype} forward loop", forward_loop)

        for spec in [*STRATEGY_NAMES, *RECOMPUTE_EVERY_ROW]:

            def fusion(spec=spec):
                kl = fused_kl(gpu, spec)
                if spec in RECOMPUTE_EVERY_ROW:  # the full prefill again, up to the dtype's rounding
                    cpu_kl = fused_kl(CausalLM.load(folder, dtype=dtype), spec)
                    assert kl <= 2 * cpu_kl + 1e-6, f"KL to the full prefill {kl}, the CPU's {cpu_kl}"
                print(f"{dtype} fusion {spec}: KL {kl:.1e}")

            check(f"{dtype} fusion {spec}", fusion)

        for selector in selector_names():

            def full_budget(selector=selector):
                for sparse, dense in full_budget_and_dense(gpu, ids, codebook, selector):
                    error = relative_error(sparse, dense)
                    assert error < FULL_BUDGET_TOLERANCE[dtype], f"full budget differs from dense by {error}"
                print(f"{dtype} {selector} full budget: {error:.1e}")

            check(f"{dtype} {selector} full budget", full_budget)
            if selector == "dense":
                continue
            backends = ["auto"] + (["flashinfer"] if dtype != torch.float32 and importable("flashinfer") else [])
            for backend in backends:

                def chosen_rows(selector=selector, backend=backend):
                    cache = gpu.new_cache(ROWS + 8)
                    gpu.prefill(ids, cache)
                    attention = SparseConfig(selector=selector, budget=32, sinks=2, window=6, backend=backend).build(
                        PromptState.from_prefill(gpu, cache, ids, 2, ROWS - 8), codebook
                    )
                    seen = {}
                    attention.observer = lambda layer, q, c, indices, start, end: seen.update(indices=indices)
                    q = torch.randn(
                        gpu.spec.num_heads, 1, gpu.spec.head_dim, generator=torch.Generator().manual_seed(0)
                    )
                    q = q.to("cuda", dtype)
                    out = attention(1, q, cache, gpu.scale)
                    assert out.is_cuda and out.dtype == dtype and torch.isfinite(out.float()).all()
                    keys, values = cache.layer(1)
                    expected, _ = reference.sparse_decode_attention(
                        q[:, 0], keys, values, seen["indices"], gpu.scale, None
                    )
                    error = relative_error(out[:, 0], expected)
                    assert error < OUT_TOLERANCE[dtype], f"differs from exact attention over its rows by {error}"
                    print(f"{dtype} {selector} {backend}: {error:.1e}")

                check(f"{dtype} {selector} budget 32 ({backend})", chosen_rows)
    return failures


@pytest.mark.skipif(not (torch.cuda.is_available() and importable("triton")), reason="needs a CUDA GPU and triton")
def test_engine_on_gpu():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, __file__], capture_output=True, text=True, env=env, timeout=900)
    assert result.returncode == 0, (result.stdout + result.stderr)[-6000:]
    assert "engine gpu checks ok" in result.stdout


if __name__ == "__main__":
    problems = check_on_gpu()
    for problem in problems:
        print(problem)
    if problems:
        sys.exit(f"{len(problems)} engine GPU check(s) failed")
    print("engine gpu checks ok")
