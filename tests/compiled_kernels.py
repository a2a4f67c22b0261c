"""Where the compiled CPU kernels must be there, and the mark of the tests that use them.

On x86_64 Linux the compiled kernels carry the product's default decode path (int4 decode
weights through the compiled step), and `scripts/install.sh` installs a C++ compiler, so
there their tests never skip: a missing compiler or a failed build fails them instead of
leaving CI green without the default. Elsewhere, or with RAGKV_CPU_EXTENSION=0, they run
only where the kernels can be built.
"""

from __future__ import annotations

import os
import platform

import pytest

from ragkv.kernels import cpu_extension


def required() -> bool:
    """Whether this machine must build the compiled kernels: x86_64 Linux with AVX2 and FMA,
    not disabled."""
    disabled = os.environ.get(cpu_extension.DISABLE_VARIABLE, "1").strip() == "0"
    vector = cpu_extension.REQUIRED_FLAGS <= cpu_extension.cpu_flags()
    return platform.system() == "Linux" and platform.machine() in ("x86_64", "AMD64") and vector and not disabled


def run_compiled_tests() -> bool:
    """Whether the compiled-kernel tests run here (and fail if the kernels cannot be had)."""
    return required() or cpu_extension.buildable()


SKIP_REASON = "the compiled CPU kernels are neither required nor buildable on this machine"
needs_compiled = pytest.mark.skipif(not run_compiled_tests(), reason=SKIP_REASON)
