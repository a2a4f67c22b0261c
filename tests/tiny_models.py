"""The one tiny-model factory of the tests: random-weight checkpoints of each supported
family, written as Hugging Face folders, so the forward loop can be compared with
transformers in seconds. `make_tiny_model` writes one (optionally with the packaged
SmolLM2's tokenizer), `tiny_weights` builds it in memory (tests/tiny_gguf.py writes those as
GGUF files).

A plain module, not conftest.py: scripts that the tests run in a subprocess or on a GPU
(tests/test_engine_gpu.py, tests/test_sparse_triton.py) import it too, and conftest.py sets
TRITON_INTERPRET for the whole process."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, Gemma3TextConfig, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

from ragkv.engine.linear import Int4Kernel

_COMMON = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=112,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)


def _config(config_class, **fields):
    """A config maker for CONFIGS: `fields`, each replaceable by the maker's keyword arguments."""
    return lambda **overrides: config_class(**{**fields, **overrides})


CONFIGS = {
    "llama": _config(LlamaConfig, **_COMMON),
    # widths in whole int4 groups of 32 (hidden 2, intermediate 3: an odd pair), weights
    # rounded to Q4_1 blocks like the packaged GGUF's (make_tiny_model: min/max blocks with a
    # float16 scale and minimum, as Int4Kernel quantizes)
    "llama-int4": _config(LlamaConfig, **{**_COMMON, "intermediate_size": 96}),
    "llama3-rope": _config(
        LlamaConfig,
        **_COMMON,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    ),
    "mistral": _config(MistralConfig, **_COMMON, sliding_window=None),
    "qwen2": _config(Qwen2Config, **_COMMON),
    "qwen3": _config(Qwen3Config, **_COMMON, head_dim=16),
    "qwen3-yarn": _config(
        Qwen3Config,
        **_COMMON,
        head_dim=16,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 128,
        },
    ),
    # For the sparse decode and fusion tests: two tied layers, a wider vocabulary, long
    # positions, and weights drawn in `tiny_weights` so attention is far from uniform
    "llama-sparse": _config(
        LlamaConfig,
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=8192,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
    ),
    # Gemma 3's layout in small: sliding-window layers with their own RoPE base around a full
    # one, a window of 8 so it cuts into a 40-token prompt, one KV head, QK-norm, a softmax
    # scale that is not 1/sqrt(head_dim), tied and scaled embeddings
    "gemma3": _config(
        Gemma3TextConfig,
        **{
            **_COMMON,
            "num_hidden_layers": 4,
            "num_key_value_heads": 1,
            "tie_word_embeddings": True,
            "rms_norm_eps": 1e-6,
        },
        head_dim=16,
        query_pre_attn_scalar=24,
        sliding_window=8,
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "sliding_attention"],
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
        },
    ),
}


_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "generation_config.json",
)


def tiny_weights(family: str, seed: int = 0, *, scale_only: bool = False, **overrides):
    """A random tiny transformers model of `family` in memory, its config's fields replaced
    by `overrides`. Weights larger than the default init spread the logits out, so greedy ties
    are unlikely; `scale_only` skips the family's extras (Gemma's norm offsets, int4 rounding)."""
    config = CONFIGS[family](**overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        if family == "llama-sparse":
            for name, parameter in model.named_parameters():
                if parameter.dim() == 2:
                    parameter.normal_(0.0, 0.15 if "embed" not in name else 1.0)
            return model
        for parameter in model.parameters():
            parameter.mul_(4.0 if parameter.dim() > 1 else 1.0)
            if scale_only:
                continue
            if family == "gemma3" and parameter.dim() == 1:
                # Gemma norms store w around zero and scale by 1 + w: non-zero w tests the offset
                parameter.add_(0.3 * torch.randn_like(parameter))
            if family == "llama-int4" and parameter.dim() == 2:
                parameter.copy_(Int4Kernel(parameter).dequantized())
    return model


def make_tiny_model(family: str, folder: Path, seed: int = 0, *, tokenizer: bool = False, **overrides) -> Path:
    """Write a random tiny model of `family` to `folder` (`tiny_weights`); return the folder.
    `tokenizer`: copy the packaged SmolLM2's tokenizer and chat template in, the vocabulary
    sized to it."""
    if tokenizer:
        from transformers import AutoTokenizer

        from ragkv.engine.model_files import resolve_model_dir

        # scripts/gpu-check.sh brings the packaged tokenizer's files where the package is not
        packaged = Path(os.environ.get("RAGKV_TEST_TOKENIZER") or resolve_model_dir(None))
        folder.mkdir(parents=True, exist_ok=True)
        for name in _TOKENIZER_FILES:
            if (packaged / name).is_file():
                shutil.copy(packaged / name, folder / name)
        overrides["vocab_size"] = len(AutoTokenizer.from_pretrained(folder))
    tiny_weights(family, seed, **overrides).save_pretrained(folder)
    return folder
