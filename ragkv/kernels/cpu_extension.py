"""The compiled CPU kernels (`ragkv/kernels/cpu/`), built once per machine.

torch's C++ extension builder compiles them on first use with the machine's compiler
(gcc is part of the supported platform; `scripts/install.sh` builds them once), tuned for
this CPU (`-march=native`), into a folder under $RAGKV_KERNEL_CACHE keyed by the sources,
the torch version and the CPU's feature flags, so a cache folder shared by different
machines never loads code built for another CPU. A machine
without a compiler, or a build that fails, keeps the torch paths: `load()` returns None
and says why once in the log.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import logging
import os
import platform
import shutil
import sysconfig
from pathlib import Path
from types import ModuleType

import torch

log = logging.getLogger("ragkv.kernels")

_FOLDER = Path(__file__).parent / "cpu"
SOURCES = tuple(_FOLDER / name for name in ("bindings.cpp", "tensor_ops.cpp", "a2ats_plan.cpp", "decode_model.cpp"))
"""The translation units: the pybind11 module, the per-op tensor entry points, the A2ATS
plan and the compiled decode step."""
HEADERS = tuple(
    _FOLDER / name
    for name in (
        "a2ats.h",
        "a2ats_plan.h",
        "attention.h",
        "bf16_flash.h",
        "cache_views.h",
        "claimed_items.h",
        "decode_model.h",
        "flash_blocks.h",
        "int4_linear.h",
        "int8_linear.h",
        "packed_linear.h",
        "selective_attention.h",
        "tensor_ops.h",
        "vec.h",
    )
)
_MACHINES = ("x86_64", "AMD64")
REQUIRED_FLAGS = frozenset({"avx2", "fma"})
"""The kernels are written for AVX2 with FMA only (no scalar fallback): other x86_64 CPUs,
and other machines, run the torch paths."""
DISABLE_VARIABLE = "RAGKV_CPU_EXTENSION"
"""Set to 0 to never build or use the compiled CPU kernels (the torch paths run instead)."""
CACHE_VARIABLE = "RAGKV_KERNEL_CACHE"
"""Where builds are kept. Not under $RAGKV_CACHE (model conversions): a process pointed at
another model cache must not pay a minute's build again."""
DEFAULT_CACHE = Path.home() / ".cache" / "ragkv" / "cpu_extension"


CACHE_DTYPES = (torch.float32, torch.bfloat16)
"""Cache dtypes the compiled attention reads (widened to float32 in registers)."""
MAX_GROUP = 16
"""Query heads per KV head the compiled attention takes (kMaxGroup in cpu/attention.h)."""
MAX_HEAD_DIM = 256
"""Largest head dim (kMaxDim in cpu/attention.h); it must also be a multiple of 8 (AVX2 lanes)."""


def supports_heads(heads: int, kv_heads: int, head_dim: int) -> bool:
    """Whether the compiled attention takes this head geometry (its C++ checks, stated once here)."""
    return heads % kv_heads == 0 and heads // kv_heads <= MAX_GROUP and head_dim % 8 == 0 and head_dim <= MAX_HEAD_DIM


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags as /proc/cpuinfo lists them (empty where it cannot be read)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def build_directory() -> Path:
    digest = hashlib.sha256()
    for source in (*SOURCES, *HEADERS):
        digest.update(source.read_bytes())
    digest.update(torch.__version__.encode())
    digest.update(" ".join(sorted(cpu_flags())).encode())
    digest.update(platform.processor().encode())
    # torch rebuilds a build directory whose sources' paths changed: two checkouts sharing
    # one directory would rebuild it in turn (and wait on each other's build lock)
    digest.update(str(SOURCES[0].parent.resolve()).encode())
    # and so would two environments building one checkout (ragkv's and vLLM's venv): their
    # torch and Python headers differ, so the compile commands differ
    digest.update(str(Path(torch.__file__).parent.resolve()).encode())
    digest.update(sysconfig.get_paths()["include"].encode())
    return Path(os.environ.get(CACHE_VARIABLE, DEFAULT_CACHE)) / digest.hexdigest()[:16]


def buildable() -> bool:
    """Whether `load()` can be expected to succeed here (not disabled, an x86_64 CPU with
    AVX2 and FMA, a C++ compiler and ninja present), without building anything."""
    if os.environ.get(DISABLE_VARIABLE, "1").strip() == "0" or platform.machine() not in _MACHINES:
        return False
    if not REQUIRED_FLAGS <= cpu_flags():
        return False
    return shutil.which(os.environ.get("CXX", "c++")) is not None and importlib.util.find_spec("ninja") is not None


@functools.cache
def load() -> ModuleType | None:
    """The compiled module, building it on first call; None where it cannot be had."""
    if not buildable():
        log.info(
            "compiled CPU kernels not built (disabled, %s without AVX2/FMA, or no compiler/ninja); torch paths run",
            platform.machine(),
        )
        return None
    from torch.utils import cpp_extension

    directory = build_directory()
    directory.mkdir(parents=True, exist_ok=True)
    if not any(directory.glob("*.so")):
        log.info("building the compiled CPU kernels into %s (once per machine, about a minute)", directory)
    try:
        return cpp_extension.load(
            name=f"ragkv_cpu_{directory.name}",
            sources=[str(source) for source in SOURCES],
            extra_cflags=["-O3", "-march=native", "-fopenmp"],
            extra_ldflags=["-fopenmp"],
            build_directory=str(directory),
            verbose=False,
        )
    except Exception as error:  # no compiler, no ninja, a failed build: the torch paths still work
        log.warning("compiled CPU kernels unavailable (%s); using the torch paths", str(error).splitlines()[0])
        return None


def build_and_report() -> None:
    """Build now and say whether the kernels are there (scripts/install.sh calls this)."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    print("compiled CPU kernels:", "ready" if load() is not None else "unavailable (torch paths run)")
