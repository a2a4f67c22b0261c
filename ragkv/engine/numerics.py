"""The number formats one model runs in, resolved once from the engine config.

Four choices, each a plain dtype or weight format name:
- dtype: the residual stream (embeddings, norms, MLP activations);
- kv_cache_dtype: q/k/v, attention and the runtime KV cache (`CausalLM.dtype`);
- weights: the linear layers when few rows pass through them (decode, small batches);
- prefill_weights: the linear layers for many rows (prefill, chunk KV, recompute).

"auto" picks by CPU capability: with bf16 matrix units (AVX512-BF16 / AMX) decode runs
int8 weights on bf16 activations, prefill runs bf16 GEMMs and the KV cache is bf16 (half
the bytes a long-context step reads); without them everything stays float32, which MKL
runs well on any x86 CPU.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from functools import lru_cache
from pathlib import Path

import torch

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
WEIGHT_FORMATS = ("float32", "bfloat16", "float16", "int8", "int4")
"""int8: per-output-channel symmetric; int4: groups of INT4_GROUP_SIZE with scale and zero."""


@lru_cache(maxsize=1)
def cpu_has_bf16_units() -> bool:
    """True when this CPU multiplies bf16 natively (AVX512-BF16 or AMX-BF16)."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


@dataclass(frozen=True)
class Numerics:
    dtype: str = "float32"
    kv_cache_dtype: str = "float32"
    weights: str = "float32"
    prefill_weights: str = "float32"

    def __post_init__(self) -> None:
        for name in ("dtype", "kv_cache_dtype"):
            if getattr(self, name) not in DTYPES:
                raise ValueError(f"{name} must be one of {sorted(DTYPES)}, got {getattr(self, name)!r}")
        if self.weights not in WEIGHT_FORMATS:
            raise ValueError(f"weights must be one of {list(WEIGHT_FORMATS)}, got {self.weights!r}")
        if self.prefill_weights not in DTYPES:
            raise ValueError(
                f"prefill_weights must be a dense dtype {sorted(DTYPES)} (quantized kernels are "
                f"for few rows), got {self.prefill_weights!r}"
            )

    @classmethod
    def uniform(cls, dtype: torch.dtype) -> "Numerics":
        """Everything in one dtype (the reference configuration tests compare against)."""
        name = next(name for name, value in DTYPES.items() if value == dtype)
        return cls(name, name, name, name)

    @property
    def hidden_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def kv_dtype(self) -> torch.dtype:
        return DTYPES[self.kv_cache_dtype]

    def fingerprint_fields(self) -> dict[str, str]:
        """Every field changes the chunk KV a model writes, so every field is in the fingerprint."""
        return asdict(self)


_BF16_CPU_DEFAULTS = {"kv_cache_dtype": "bfloat16", "weights": "int8", "prefill_weights": "bfloat16"}


def resolve_numerics(dtype: str, kv_cache_dtype: str, weights: str, prefill_weights: str, device: str) -> Numerics:
    """Replace each "auto" by the format measured fastest for `device` (see module doc):
    the bf16/int8 mix on a CPU with bf16 units, else the residual stream's dtype."""
    on_cpu = torch.device(device).type == "cpu"
    if weights in ("int8", "int4") and not on_cpu:
        raise ValueError(f"weights={weights!r} uses torch's packed CPU kernels; it needs device='cpu'")
    use_bf16_mix = on_cpu and cpu_has_bf16_units()
    chosen = {"kv_cache_dtype": kv_cache_dtype, "weights": weights, "prefill_weights": prefill_weights}
    for name, value in chosen.items():
        if value == "auto":
            chosen[name] = _BF16_CPU_DEFAULTS[name] if use_bf16_mix else dtype
    return Numerics(dtype=dtype, **chosen)
