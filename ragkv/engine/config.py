"""What an Engine is built from. Torch-free to import: commands build their options from
it and refuse bad input before any model library loads; its checks and the "auto"
formats import the numerics (and torch) only when a config is made."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ragkv.engine.prompt import DEFAULT_SYSTEM_PROMPT

if TYPE_CHECKING:
    from ragkv.engine.numerics import Numerics


@dataclass(frozen=True)
class EngineConfig:
    model: str | None = None
    """A GGUF file, a local Hugging Face folder or a hub id in the local Hugging Face cache, of
    Llama, Mistral, Qwen2, Qwen3 or Gemma 3 (ragkv.engine.model_files); None = packaged SmolLM2."""
    dtype: str = "float32"
    """dtype of the residual stream (embeddings, norms, MLP activations)."""
    weights: str = "auto"
    """Linear-layer format for decode rows: float32, bfloat16, float16, int8 (per-channel) or
    int4 (groups of 32, float16 scale and minimum); auto = int4 on a CPU where the compiled
    kernels build, int8 on other CPUs, `dtype` elsewhere (ragkv.engine.numerics)."""
    prefill_weights: str = "auto"
    """Linear-layer format for prefill, chunk KV and recompute (a dense dtype); auto =
    bfloat16 on a CPU with bf16 units, else `dtype`."""
    kv_cache_dtype: str = "auto"
    """dtype of q/k/v, attention and the runtime KV cache (bfloat16 halves the bytes a
    decode step reads at long context); auto = bfloat16 on a CPU with bf16 units, else `dtype`."""
    kv_storage: str = "int4"
    """Format of chunk K/V in the store: float32, float16, bfloat16, int8 or int4 (KIVI-style
    integer codes, dequantised while placed); part of the model fingerprint. int4 costs a
    quarter of float16's bytes for a first-token KL of a few thousandths (BENCHMARKS.md)."""
    device: str = "cpu"
    """torch device the model runs on: cpu, or cuda / cuda:N (a GPU torch can see; "auto"
    formats then run in bfloat16 on its tensor cores)."""
    system_prompt: str = DEFAULT_SYSTEM_PROMPT
    precompute_prefix: bool = True
    """Compute each chunk's KV after the RAG prefix (system prompt + instruction), so the
    chunk's first token is not an attention sink; the prefix is then stripped."""
    threads: int | None = None
    """torch intra-op threads; None keeps torch's default (all cores)."""

    def __post_init__(self) -> None:
        from ragkv.engine.kv_storage import KV_STORAGE_FORMATS
        from ragkv.engine.numerics import DTYPES, WEIGHT_FORMATS

        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        if self.kv_storage not in KV_STORAGE_FORMATS:
            raise ValueError(f"kv_storage must be one of {sorted(KV_STORAGE_FORMATS)}, got {self.kv_storage!r}")
        for name, allowed in (
            ("weights", WEIGHT_FORMATS),
            ("prefill_weights", tuple(DTYPES)),
            ("kv_cache_dtype", tuple(DTYPES)),
        ):
            if getattr(self, name) not in ("auto", *allowed):
                raise ValueError(f"{name} must be one of {['auto', *allowed]}, got {getattr(self, name)!r}")
        check_device(self.device)
        self.numerics()
        if self.threads is not None and self.threads < 1:
            raise ValueError("threads must be >= 1")

    def numerics(self) -> Numerics:
        """The formats the model runs in, each "auto" resolved for this machine."""
        from ragkv.engine.numerics import resolve_numerics

        return resolve_numerics(self.dtype, self.kv_cache_dtype, self.weights, self.prefill_weights, self.device)


def check_device(device: str) -> None:
    """ValueError unless `device` names a device this torch can run on."""
    import torch

    try:
        parsed = torch.device(device)
    except (RuntimeError, ValueError):
        raise ValueError(f"device must be cpu, cuda or cuda:N, got {device!r}") from None
    if parsed.type == "cpu":
        return
    if parsed.type != "cuda":
        raise ValueError(f"device must be cpu, cuda or cuda:N, got {device!r}")
    if not torch.cuda.is_available():
        raise ValueError(f"device {device!r}: this torch ({torch.__version__}) sees no CUDA GPU")
    if parsed.index is not None and parsed.index >= torch.cuda.device_count():
        raise ValueError(f"device {device!r}: torch sees {torch.cuda.device_count()} CUDA GPU(s)")
