"""`ragkv bench kernels` on the CPU at a tiny geometry: every op runs on the backends it can
here, agrees with the torch reference, and the random-weight step runs dense and sparse."""

from __future__ import annotations

import json

import pytest
import torch

from ragkv.bench.kernel_bench import Geometry, KernelBenchConfig, format_table, run_kernel_bench
from ragkv.cli.main import main

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
    # triton runs in its interpreter here (conftest sets TRITON_INTERPRET); flashinfer needs a GPU
    assert ran == {(op, backend) for op in config.ops for backend in ("torch", "triton")}
    for row in result.kernels:
        if row.ms is not None:
            assert row.rel_err < 1e-5, row
        else:
            assert "flashinfer" in row.error, row
    assert [(row.mode, row.selected_rows) for row in result.steps] == [
        ("dense-torch", 80),
        ("dense-triton", 80),
        ("sparse-triton", 5),
    ]
    assert all(row.ms > 0 and not row.error for row in result.steps)
    assert "sparse-triton" in format_table(result)


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
