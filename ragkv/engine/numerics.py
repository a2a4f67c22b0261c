"""The number formats one model runs in, resolved once from the engine config.

Four choices, each a plain dtype or weight format name:
- dtype: the residual stream (embeddings, norms, MLP activations);
- kv_cache_dtype: q/k/v and the runtime KV cache (`CausalLM.dtype`);
- weights: the linear layers when few rows pass through them (decode, small batches);
- prefill_weights: the linear layers for many rows (prefill, chunk KV, recompute).

"auto" picks by measurement on two CPU kinds (BENCHMARKS.md):
- decode weights: int4 where the compiled CPU kernels build (integer dot products on int8
  activations; a Q4_1 GGUF's layers exactly, so its first-token KL against float32 weights
  is below int8's, and a step reads fewer bytes), else int8 (torch's packed kernel reads a
  quarter of float32's bytes; torch's int4 kernel rounds its scales to bf16, which costs
  too much accuracy);
- prefill weights: bfloat16 where the CPU has bf16 matrix units (AVX512-BF16 / AMX: a
  bf16 GEMM is several times faster than float32), else the residual dtype (without them
  torch emulates bf16 and a GEMM is an order of magnitude slower than float32);
- KV cache: bfloat16 (half the bytes a long-context decode step reads) where the CPU has
  bf16 units or the compiled CPU kernels can be built (they read bf16 rows and compute in
  float32); else the residual dtype.
Attention math on 16-bit caches runs in float32 on CPUs that cannot multiply that type
natively (`attention_compute_dtype`).
On a GPU every "auto" is bfloat16: its tensor cores multiply 16-bit operands at many times
float32's rate, and a decode step reads half the bytes.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from ragkv.kernels import cpu_extension

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
WEIGHT_FORMATS = ("float32", "bfloat16", "float16", "int8", "int4")
"""int8: per-output-channel symmetric; int4: groups of INT4_GROUP_SIZE with a float16 scale and
minimum (a GGUF Q4_1 checkpoint exactly; the LM head then int8, `Numerics.lm_head_weights`)."""


def cpu_has_bf16_units() -> bool:
    """True when this CPU multiplies bf16 natively (AVX512-BF16 or AMX-BF16)."""
    return bool({"avx512_bf16", "amx_bf16"} & cpu_extension.cpu_flags())


def cpu_has_fp16_units() -> bool:
    """True when this CPU multiplies float16 natively (AVX512-FP16 or AMX-FP16)."""
    return bool({"avx512_fp16", "amx_fp16"} & cpu_extension.cpu_flags())


def attention_compute_dtype(dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The dtype attention over a `dtype` cache computes in: the cache's own where the
    device multiplies it natively, float32 on CPUs that would emulate it (an emulated bf16
    matmul is several times slower than float32)."""
    if device.type != "cpu" or dtype == torch.float32:
        return dtype
    native = cpu_has_bf16_units() if dtype == torch.bfloat16 else cpu_has_fp16_units()
    return dtype if native else torch.float32


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
    def uniform(cls, dtype: torch.dtype) -> Numerics:
        """Everything in one dtype (the reference configuration tests compare against)."""
        name = next(name for name, value in DTYPES.items() if value == dtype)
        return cls(name, name, name, name)

    @property
    def lm_head_weights(self) -> str:
        """The LM head's decode format: int8 where the layers are int4. A GGUF keeps the
        (tied) embedding in 8 bits (SmolLM2's Q4_1 file: Q8_0), which int4 groups round
        coarser: on the head alone int4 moved the first token's distribution far more than
        int8 (BENCHMARKS.md), for only a small share of the bytes a step reads."""
        return "int8" if self.weights == "int4" else self.weights

    @property
    def hidden_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def kv_dtype(self) -> torch.dtype:
        return DTYPES[self.kv_cache_dtype]

    def fingerprint_fields(self) -> dict[str, str]:
        """Every field changes the chunk KV a model writes, so every field is in the fingerprint."""
        return asdict(self)


def resolve_numerics(dtype: str, kv_cache_dtype: str, weights: str, prefill_weights: str, device: str) -> Numerics:
    """Replace each "auto" by the format measured fastest for `device` (see module doc)."""
    on_cpu = torch.device(device).type == "cpu"
    if weights in ("int8", "int4") and not on_cpu:
        raise ValueError(f"weights={weights!r} uses torch's packed CPU kernels; it needs device='cpu'")
    bf16_units = on_cpu and cpu_has_bf16_units()
    if on_cpu:
        automatic = {
            "weights": "int4" if cpu_extension.buildable() else "int8",
            "prefill_weights": "bfloat16" if bf16_units else dtype,
            "kv_cache_dtype": "bfloat16" if bf16_units or cpu_extension.buildable() else dtype,
        }
    else:  # a GPU: tensor cores multiply 16-bit operands; the stream keeps `dtype`
        automatic = {"weights": "bfloat16", "prefill_weights": "bfloat16", "kv_cache_dtype": "bfloat16"}
    chosen = {"kv_cache_dtype": kv_cache_dtype, "weights": weights, "prefill_weights": prefill_weights}
    for name, value in chosen.items():
        if value == "auto":
            chosen[name] = automatic[name]
    return Numerics(dtype=dtype, **chosen)
