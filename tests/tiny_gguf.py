"""Tiny random models written as GGUF files with the `gguf` package, as llama.cpp's converter
would write them (tensor names, Llama's q/k row order, quantised blocks), with a real
tokenizer: the packaged SmolLM2 file's byte-level BPE cut to its first `VOCAB` tokens and
the merges that build them, and its ChatML template."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import gguf
import numpy as np
from tiny_models import tiny_weights

VOCAB = 1024
_FIRST_MERGED_ID = 252
"""SmolLM2's merge i makes token 252 + i (17 special tokens, then its byte alphabet)."""

_ARCH = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}
"""llama.cpp writes Mistral as "llama" (transformers tells it by the name)."""


@lru_cache(maxsize=1)
def smollm2_tokenizer() -> dict:
    from ragkv.engine.model_files import packaged_gguf_path

    reader = gguf.GGUFReader(str(packaged_gguf_path()))

    def strings(key: str) -> list[str]:
        field = reader.fields[key]
        return [bytes(field.parts[i]).decode() for i in field.data]

    def scalar(key: str):
        field = reader.fields[key]
        return field.parts[field.data[0]]

    token_types = reader.fields["tokenizer.ggml.token_type"]
    return {
        "tokens": strings("tokenizer.ggml.tokens")[:VOCAB],
        "types": [int(token_types.parts[i][0]) for i in token_types.data][:VOCAB],
        "merges": strings("tokenizer.ggml.merges")[: VOCAB - _FIRST_MERGED_ID],
        "template": bytes(scalar("tokenizer.chat_template")).decode(),
    }


_K_QUANT_HALVES = {"Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}
"""Byte offsets of the float16 super-block scales in each K-quant block (the rest is codes
and 6-bit sub-scales, any bytes of which are a valid block)."""


def random_k_quant_blocks(rows: int, columns: int, kind: gguf.GGMLQuantizationType, seed: int) -> np.ndarray:
    """Random valid K-quant blocks [rows, bytes] (gguf-py can read K-quants but not write
    them): random codes and sub-scales under small float16 super-block scales."""
    block_bytes = gguf.GGML_QUANT_SIZES[kind][1]
    generator = np.random.default_rng(seed)
    blocks = generator.integers(0, 256, (rows, columns // 256, block_bytes), dtype=np.uint8)
    for offset in _K_QUANT_HALVES[kind.name]:
        blocks[..., offset : offset + 2] = (
            np.full(blocks.shape[:2], 5e-4, np.float16).view(np.uint8).reshape(*blocks.shape[:2], 2)
        )
    return blocks.reshape(rows, -1)


def _llama_permute(weights: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's reordering of q/k rows (transformers' GGUF reader undoes it)."""
    return (
        weights.reshape(heads, 2, weights.shape[0] // heads // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


def write_tiny_gguf(
    family: str,
    path: Path,
    matrix_type: str = "F32",
    seed: int = 0,
    name: str | None = None,
    architecture: str | None = None,
    context_length: int | None = None,
    hidden_size: int | None = None,
) -> Path:
    """A random tiny `family` model (tests/tiny_models.py's config, vocabulary VOCAB) at
    `path`, its matrices stored as `matrix_type` (F32, F16, BF16, Q8_0, Q4_0, Q4_1) and its
    norms and biases as F32. `architecture` overrides the file's declared architecture,
    `context_length` the config's 512 positions. K-quant types (Q4_K, Q5_K, Q6_K) need rows
    of 256 (`hidden_size` 256): those matrices get random valid blocks, the others F16."""
    sizes = {"max_position_embeddings": context_length, "hidden_size": hidden_size}
    overrides = {name: value for name, value in sizes.items() if value}
    # every width whole blocks of 32
    model = tiny_weights(family, seed, scale_only=True, vocab_size=VOCAB, intermediate_size=96, **overrides)
    config = model.config
    arch = architecture or _ARCH[family]
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(name or f"tiny-{family}")
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_freq_base(float(config.rope_parameters["rope_theta"]))
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(VOCAB)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    writer.add_rope_dimension_count(head_dim)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    tokenizer = smollm2_tokenizer()
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(tokenizer["tokens"])
    writer.add_token_types(tokenizer["types"])
    writer.add_token_merges(tokenizer["merges"])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_pad_token_id(2)
    writer.add_add_bos_token(False)
    writer.add_chat_template(tokenizer["template"])

    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[_ARCH[family].upper()], config.num_hidden_layers)
    for hf_name, tensor in model.state_dict().items():
        if config.tie_word_embeddings and hf_name == "lm_head.weight":
            continue
        stem, suffix = hf_name.rsplit(".", 1)
        gguf_name = f"{names.get_name(stem)}.{suffix}"
        data = tensor.numpy()
        if _ARCH[family] == "llama" and gguf_name.endswith(("attn_q.weight", "attn_k.weight")):
            heads = config.num_attention_heads if "attn_q" in gguf_name else config.num_key_value_heads
            data = _llama_permute(data, heads)
        kind = gguf.GGMLQuantizationType[matrix_type if data.ndim == 2 else "F32"]
        if kind.name in _K_QUANT_HALVES:
            if data.shape[1] % 256 == 0:
                blocks = random_k_quant_blocks(*data.shape, kind, seed=len(writer.tensors[0]))
                writer.add_tensor(gguf_name, blocks, raw_dtype=kind)
                continue
            kind = gguf.GGMLQuantizationType.F16
        if kind == gguf.GGMLQuantizationType.F32:
            writer.add_tensor(gguf_name, np.ascontiguousarray(data, dtype=np.float32))
        else:
            writer.add_tensor(gguf_name, gguf.quants.quantize(data, kind), raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
