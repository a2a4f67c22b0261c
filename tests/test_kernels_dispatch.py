"""Backend selection rules and the package's independence from triton/flashinfer."""

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ragkv.kernels import BackendUnavailableError, apply_rope
from ragkv.kernels.dispatch import importable, select_backend

CPU = torch.device("cpu")
CUDA = torch.device("cuda")  # only compared, never allocated on
REPO = Path(__file__).resolve().parents[1]


def test_auto_uses_reference_on_cpu_even_when_interpreting():
    assert select_backend("op", "auto", CPU, ("triton", "flashinfer")) == "torch"


@pytest.mark.skipif(not importable("triton"), reason="needs triton")
def test_auto_prefers_triton_on_cuda():
    assert select_backend("op", "auto", CUDA, ("triton", "flashinfer")) == "triton"


@pytest.mark.skipif(importable("flashinfer"), reason="needs flashinfer absent")
def test_auto_skips_unimportable_flashinfer():
    assert select_backend("op", "auto", CUDA, ("flashinfer",)) == "torch"


@pytest.mark.skipif(not importable("triton"), reason="needs triton")
def test_forced_triton_on_cpu_needs_interpreter(monkeypatch):
    assert select_backend("op", "triton", CPU, ("triton",)) == "triton"
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(BackendUnavailableError, match="TRITON_INTERPRET"):
        select_backend("op", "triton", CPU, ("triton",))


def test_forcing_a_missing_backend_raises():
    with pytest.raises(BackendUnavailableError, match="apply_rope has no flashinfer backend"):
        apply_rope(torch.randn(1, 2, 4), torch.randn(2, 4), torch.randn(2, 4), backend="flashinfer")
    with pytest.raises(ValueError, match="unknown backend"):
        select_backend("op", "cuda", CPU, ("triton",))


def test_mixed_devices_rejected():
    with pytest.raises(ValueError, match="one device"):
        apply_rope(torch.randn(1, 2, 4), torch.randn(2, 4, device="meta"), torch.randn(2, 4))


def test_package_works_without_triton_or_flashinfer():
    """Block both imports in a fresh interpreter: every op still runs on the reference."""
    script = """
import sys
sys.modules["triton"] = None
sys.modules["flashinfer"] = None
import torch
from ragkv import kernels
x = torch.randn(2, 3, 8)
assert kernels.apply_rope(x, torch.ones(3, 8), torch.zeros(3, 8)).equal(x)
kernels.code_score_topk(torch.randn(2, 4), torch.randint(0, 4, (2, 6)), 2)
kernels.sparse_decode_attention(torch.randn(4, 8), x, x, torch.zeros(2, 1, dtype=torch.long), 0.3)
kernels.selective_attention(torch.randn(4, 1, 8), x, x, torch.tensor([2]), 0.3)
try:
    kernels.apply_rope(x, torch.ones(3, 8), torch.zeros(3, 8), backend="triton")
except kernels.BackendUnavailableError as e:
    assert "triton is not importable" in str(e)
else:
    raise AssertionError("forced triton did not raise")
print("ok")
"""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr


DISPATCH_POINT = {"ragkv/kernels/dispatch.py", "ragkv/kernels/cpu_extension.py"}


def compiled_module_loads(source: str) -> int:
    """Calls of cpu_extension.load (or a bare `load` imported from it) in `source`."""
    tree = ast.parse(source)
    bare = {
        alias.asname or alias.name
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and (node.module or "").endswith("cpu_extension")
        for alias in node.names
        if alias.name == "load"
    }
    count = 0
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        named = isinstance(func, ast.Attribute) and func.attr == "load"
        if named and ast.unparse(func.value).endswith("cpu_extension"):
            count += 1
        elif isinstance(func, ast.Name) and func.id in bare:
            count += 1
    return count


def test_only_the_dispatch_point_obtains_the_compiled_module():
    """Every op and the compiled decode step ask `dispatch.compiled()`; none loads the module itself."""
    loaders = [
        str(path.relative_to(REPO))
        for path in sorted((REPO / "ragkv").rglob("*.py"))
        if str(path.relative_to(REPO)) not in DISPATCH_POINT and compiled_module_loads(path.read_text())
    ]
    assert loaders == []


def test_the_load_scan_sees_a_load():
    assert compiled_module_loads("from ragkv.kernels import cpu_extension\nm = cpu_extension.load()\n") == 1
    assert compiled_module_loads("from ragkv.kernels.cpu_extension import load as get\nm = get()\n") == 1
    assert compiled_module_loads("from ragkv.kernels import dispatch\nm = dispatch.compiled()\n") == 0
