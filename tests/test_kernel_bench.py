"""`ragkv bench kernels` on the CPU at a tiny geometry: every op runs on the backends it can
here, agrees with the torch reference, and the random-weight step runs dense and sparse."""

from __future__ import annotations

import json

import pytest
import torch

from ragkv.bench.kernel_bench import Geometry, KernelBenchConfig, backends_of, format_table, run_kernel_bench
from ragkv.cli.main import main
from ragkv.kernels import bf16_flash, cpu_extension

TINY = Geometry("tiny", layers=2, q_heads=4, kv_heads=2, head_dim=16, hidden=32, intermediate=64, vocab=50)


def test_ops_match_reference_and_steps_run():
    config = KernelBenchConfig(
        TINY,
        contexts=(80,),
        dtype=torch.float32,
        device="cpu",
        step_modes=("dense-torch", "dense-triton", "sparse-triton"),
    )
    result = run_kernel_bench(config)
    ran = {(row.op, row.backend) for row in result.kernels if row.ms is not None}
    # triton runs in its interpreter here (conftest sets TRITON_INTERPRET); flashinfer needs a
    # GPU; the flash backends take bfloat16 caches only, the compiled one runs where it builds
    compiled = {("selective_attention", "cpp")} if cpu_extension.load() is not None else set()
    assert ran == {(op, backend) for op in config.ops for backend in ("torch", "triton")} | compiled
    for row in result.kernels:
        if row.ms is not None:
            assert row.rel_err < 1e-5, row
        else:
            assert any(name in row.error for name in ("flashinfer", "no bf16_flash", "no cpu_flash")), row
    assert [(row.mode, row.selected_rows) for row in result.steps] == [
        ("dense-torch", 80),
        ("dense-triton", 80),
        ("sparse-triton", 5),
    ]
    assert all(row.ms > 0 and not row.error for row in result.steps)
    assert "sparse-triton" in format_table(result)


def test_the_cpu_flash_backends_are_timed_side_by_side_on_bfloat16():
    """At a head dim of 64, bfloat16: torch's flash kernel and the compiled bf16 loop (where it
    was built) in one run, both near the reference; on a GPU the CPU backends are left out."""
    geometry = Geometry("tiny64", layers=1, q_heads=6, kv_heads=2, head_dim=64, hidden=32, intermediate=64, vocab=50)
    config = KernelBenchConfig(
        geometry, contexts=(300,), dtype=torch.bfloat16, device="cpu", ops=("selective_attention",), step_modes=()
    )
    rows = {row.backend: row for row in run_kernel_bench(config).kernels}
    expected = {"cpu_flash"} | ({"bf16_flash"} if bf16_flash.built(cpu_extension.load()) else set())
    assert expected <= {backend for backend, row in rows.items() if row.ms is not None}
    for backend in expected:
        assert rows[backend].rel_err < 2e-2, rows[backend]
    assert "bf16_flash" not in backends_of("selective_attention", torch.device("cuda"))


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="contexts"):
        KernelBenchConfig(TINY, contexts=(8,))
    with pytest.raises(ValueError, match="unknown"):
        KernelBenchConfig(TINY, ops=("nope",))
    with pytest.raises(ValueError, match="not a torch device"):
        KernelBenchConfig(TINY, device="nope")
    with pytest.raises(ValueError, match="multiple"):
        Geometry("odd", 1, 5, 2, 16, 32, 64, 50)


def test_cli_writes_json(tmp_path, capsys):
    out = tmp_path / "kernels.json"
    code = main(
        [
            "bench",
            "kernels",
            "--geometry",
            "smollm2-135m",
            "--device",
            "cpu",
            "--dtype",
            "float32",
            "--contexts",
            "32",
            "--ops",
            "apply_rope",
            "dense_decode",
            "--step-modes",
            "--json",
            str(out),
        ]
    )
    assert code == 0
    figures = json.loads(out.read_text())
    assert figures["device"] == "cpu" and not figures["steps"]
    assert {row["op"] for row in figures["kernels"]} == {"apply_rope", "dense_decode"}
    assert "apply_rope" in capsys.readouterr().out
