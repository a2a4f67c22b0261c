"""CI fails, not skips, where the compiled CPU kernels are the product default and cannot be built."""

from __future__ import annotations

import pytest
from compiled_kernels import required  # pytest puts tests/ on sys.path (no tests/__init__.py)

from ragkv.engine.numerics import resolve_numerics
from ragkv.kernels import cpu_extension


@pytest.mark.skipif(not required(), reason="the compiled CPU kernels are required on x86_64 Linux (AVX2, FMA) only")
def test_the_compiled_kernels_build_where_they_are_the_default():
    assert cpu_extension.buildable(), "no C++ compiler or ninja on this x86_64 Linux machine: run scripts/install.sh"
    assert cpu_extension.load() is not None, "the compiled CPU kernels failed to build (see the log)"
    # and the default numerics take the compiled path: int4 decode weights
    assert resolve_numerics("float32", "auto", "auto", "auto", "cpu").weights == "int4"


@pytest.mark.parametrize("missing", sorted(cpu_extension.REQUIRED_FLAGS))
def test_a_cpu_without_avx2_and_fma_runs_the_torch_paths(monkeypatch, missing):
    """The kernels have no scalar fallback, so such a CPU never builds them."""
    flags = cpu_extension.cpu_flags() | cpu_extension.REQUIRED_FLAGS
    monkeypatch.setattr(cpu_extension, "cpu_flags", lambda: flags - {missing})
    assert not cpu_extension.buildable()
