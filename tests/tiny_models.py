"""Tiny random-weight checkpoints of each supported family, written as Hugging Face
folders, so the forward loop can be compared with transformers in seconds."""

from __future__ import annotations

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

CONFIGS = {
    "llama": lambda: LlamaConfig(**_COMMON),
    # widths in whole int4 groups of 32 (hidden 2, intermediate 3: an odd pair), weights
    # rounded to Q4_1 blocks like the packaged GGUF's (make_tiny_model: min/max blocks with a
    # float16 scale and minimum, as Int4Kernel quantizes)
    "llama-int4": lambda: LlamaConfig(**{**_COMMON, "intermediate_size": 96}),
    "llama3-rope": lambda: LlamaConfig(
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
    "mistral": lambda: MistralConfig(**_COMMON, sliding_window=None),
    "qwen2": lambda: Qwen2Config(**_COMMON),
    "qwen3": lambda: Qwen3Config(**_COMMON, head_dim=16),
    "qwen3-yarn": lambda: Qwen3Config(
        **_COMMON,
        head_dim=16,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 128,
        },
    ),
    # Gemma 3's layout in small: sliding-window layers with their own RoPE base around a full
    # one, a window of 8 so it cuts into a 40-token prompt, one KV head, QK-norm, a softmax
    # scale that is not 1/sqrt(head_dim), tied and scaled embeddings
    "gemma3": lambda: Gemma3TextConfig(
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


def make_tiny_model(family: str, folder: Path, seed: int = 0) -> Path:
    """Write a random tiny model of `family` to `folder`; return the folder."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(CONFIGS[family](), dtype=torch.float32)
    with torch.no_grad():
        # Larger-than-init weights make logits spread out, so greedy ties are unlikely.
        for parameter in model.parameters():
            parameter.mul_(4.0 if parameter.dim() > 1 else 1.0)
            if family == "gemma3" and parameter.dim() == 1:
                # Gemma norms store w around zero and scale by 1 + w: non-zero w tests the offset
                parameter.add_(0.3 * torch.randn_like(parameter))
            if family == "llama-int4" and parameter.dim() == 2:
                parameter.copy_(Int4Kernel(parameter).dequantized())
    model.save_pretrained(folder)
    return folder


def fusion_case(model, vocab: int, seed: int = 3):
    """(fusion input, prefix cache, full-prefill logits): three 40-token chunks of random ids
    below `vocab`, encoded after a 6-token prefix, then an 8-token question."""
    from ragkv.fusion import FusionInput, LoadedChunk

    generator = torch.Generator().manual_seed(seed)
    prefix = torch.randint(3, vocab, (6,), generator=generator)
    prefix_cache = model.new_cache(prefix.numel())
    model.prefill(prefix, prefix_cache)
    chunks = []
    for _ in range(3):
        ids = torch.randint(3, vocab, (40,), generator=generator)
        keys, values = model.chunk_kv(ids, prefix_cache)
        chunks.append(LoadedChunk(ids.tolist(), keys, values))
    question = torch.randint(3, vocab, (8,), generator=generator).tolist()
    fusion_input = FusionInput(prefix.tolist(), chunks, question, chunk_precompute_offset=prefix.numel())
    whole = torch.tensor(prefix.tolist() + sum((chunk.token_ids for chunk in chunks), []) + question)
    return fusion_input, prefix_cache, model.prefill(whole, model.new_cache(whole.numel()))
