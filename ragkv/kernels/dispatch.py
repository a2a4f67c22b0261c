"""Backend selection shared by every op launcher.

Each launcher asks :func:`select_backend` once and then runs exactly one
implementation, so the rules for "which code runs" live in one place:

* ``"auto"`` picks Triton for CUDA tensors when Triton imports, then FlashInfer
  (only for ops that have it) for CUDA tensors when FlashInfer imports, then the compiled
  AVX512-BF16 flash loop (``"bf16_flash"``, only for ops that have it) where it was built
  and the CPU has no AMX, then torch's CPU flash-attention kernel (``"cpu_flash"``, only for
  ops that have it) on CPUs with AVX512-BF16, then the compiled CPU kernel (``"cpp"``, only
  for ops that have it) for CPU tensors when it builds on this machine, else the torch path. Triton never runs
  CPU tensors under ``"auto"``: its CPU interpreter is a testing tool, far slower than
  torch.
* ``"triton"`` additionally runs on CPU tensors when ``TRITON_INTERPRET=1`` is set,
  which is how the test-suite exercises the kernels without a GPU; likewise
  ``"cpu_flash"`` runs on any CPU when forced (correct, but slow without AVX512-BF16), and
  ``"bf16_flash"`` on AMX CPUs too.
* Forcing a backend the op lacks, or one that cannot run here, raises
  :class:`BackendUnavailableError` instead of silently falling back, so a test that
  asks for Triton really tests Triton.

Nothing here imports triton or flashinfer at module import time: the package must
import on machines that have neither.
"""

from __future__ import annotations

import functools
import importlib
import os
from types import ModuleType
from typing import Literal

import torch

from ragkv.kernels import bf16_flash, cpu_extension, cpu_flash

Backend = Literal["auto", "torch", "triton", "flashinfer", "bf16_flash", "cpu_flash", "cpp"]
BACKENDS: tuple[str, ...] = ("auto", "torch", "triton", "flashinfer", "bf16_flash", "cpu_flash", "cpp")

# Order in which "auto" tries the accelerated backends. Triton comes first because
# it is the path the test-suite verifies (under the interpreter); the device decides
# between the GPU ones and the CPU ones. Of the CPU ones, the bf16 dot-product loop outruns
# torch's flash kernel where there is no AMX, and torch's flash kernel (bfloat16 matmuls on
# AMX/AVX512-BF16) outruns the compiled float32 FMA kernel.
_AUTO_ORDER: tuple[str, ...] = ("triton", "flashinfer", "bf16_flash", "cpu_flash", "cpp")


def compiled() -> ModuleType | None:
    """The compiled CPU kernels' module, built on first call; None where they cannot be had.
    The one place that obtains it: every op and the compiled decode step ask here."""
    return cpu_extension.load()


class BackendUnavailableError(RuntimeError):
    """A forced backend is not implemented for the op or cannot run on these inputs."""


@functools.cache
def importable(module: str) -> bool:
    """Whether ``module`` imports cleanly (cached: importing triton is slow)."""
    try:
        importlib.import_module(module)
    except Exception:  # a broken install (e.g. missing CUDA libs) counts as absent
        return False
    return True


def triton_interpret() -> bool:
    """Whether Triton will run kernels in its CPU interpreter (read at each call)."""
    return os.environ.get("TRITON_INTERPRET", "").strip().lower() in ("1", "true", "yes", "on")


def _unusable_reason(backend: str, device: torch.device, forced: bool) -> str | None:
    """Why ``backend`` cannot run on ``device``, or None when it can."""
    if backend == "torch":
        return None
    if backend == "triton":
        if not importable("triton"):
            return "triton is not importable"
        if device.type == "cuda" or (forced and triton_interpret()):
            return None
        return f"tensors are on {device.type} and TRITON_INTERPRET=1 is not set"
    if backend == "cpp":
        if device.type != "cpu":
            return f"the compiled CPU kernels need CPU tensors, got {device.type}"
        if compiled() is None:
            return "the compiled CPU kernels could not be built here (see the log)"
        return None
    if backend == "bf16_flash":
        if device.type != "cpu":
            return f"the compiled bf16 flash loop needs CPU tensors, got {device.type}"
        if not bf16_flash.built(compiled()):
            return "the compiled CPU kernels were not built for AVX512-BF16 here"
        if not forced and not bf16_flash.preferred_here():
            return "this CPU has AMX, where torch's flash kernel is faster"
        return None
    if backend == "cpu_flash":
        if device.type != "cpu":
            return f"torch's CPU flash kernel needs CPU tensors, got {device.type}"
        if not cpu_flash.available():
            return "this torch has no CPU flash kernel returning logsumexps"
        if not forced and not cpu_flash.fast_here():
            return "this CPU lacks AVX512-BF16"
        return None
    if backend == "flashinfer":
        if device.type != "cuda":
            return f"flashinfer needs CUDA tensors, got {device.type}"
        if not importable("flashinfer"):
            return "flashinfer is not importable"
        return None
    raise ValueError(f"unknown backend {backend!r}; expected one of {BACKENDS}")


def select_backend(op: str, requested: str, device: torch.device, kernels: tuple[str, ...]) -> str:
    """Resolve ``requested`` to the one backend that will run ``op`` on ``device``.

    ``kernels`` lists the accelerated backends ``op`` implements for these inputs
    (the torch reference always exists).
    """
    if requested not in BACKENDS:
        raise ValueError(f"{op}: unknown backend {requested!r}; expected one of {BACKENDS}")
    if requested == "auto":
        for candidate in _AUTO_ORDER:
            if candidate in kernels and _unusable_reason(candidate, device, forced=False) is None:
                return candidate
        return "torch"
    if requested != "torch" and requested not in kernels:
        raise BackendUnavailableError(
            f"{op} has no {requested} backend for these inputs (available: {', '.join(('torch', *kernels))})"
        )
    reason = _unusable_reason(requested, device, forced=True)
    if reason is not None:
        raise BackendUnavailableError(f"{op}: backend {requested!r} unavailable: {reason}")
    return requested
