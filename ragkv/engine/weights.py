"""Model weights as plain tensors, laid out for the forward loop.

q/k/v projections are fused into one matrix and gate/up into another so each layer does
two large matmuls instead of five small ones.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from ragkv.engine.model_spec import ModelSpec


@dataclass
class LayerWeights:
    input_norm: torch.Tensor
    qkv: torch.Tensor  # [hidden, (Hq + 2 Hkv) * D], transposed for x @ W
    qkv_bias: torch.Tensor | None
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    o_proj: torch.Tensor  # [Hq * D, hidden]
    post_attention_norm: torch.Tensor
    gate_up: torch.Tensor  # [hidden, 2 * intermediate]
    down: torch.Tensor  # [intermediate, hidden]


@dataclass
class ModelWeights:
    embed: torch.Tensor  # [vocab, hidden]
    layers: list[LayerWeights]
    final_norm: torch.Tensor
    lm_head: torch.Tensor  # [hidden, vocab]


def weight_files(model_dir: Path) -> list[Path]:
    """The safetensors files that hold a model's weights (the fingerprint hashes these)."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [model_dir / name for name in names]
    single = model_dir / "model.safetensors"
    if single.is_file():
        return [single]
    raise FileNotFoundError(f"no safetensors weights in {model_dir}")


def load_weights(model_dir: Path, spec: ModelSpec, dtype: torch.dtype, device: torch.device | str) -> ModelWeights:
    raw: dict[str, torch.Tensor] = {}
    for path in weight_files(model_dir):
        with safe_open(str(path), framework="pt", device="cpu") as handle:
            for name in handle.keys():
                raw[name] = handle.get_tensor(name)

    def take(name: str) -> torch.Tensor:
        if name not in raw:
            raise KeyError(f"weight {name!r} missing from {model_dir}")
        return raw[name].to(device=device, dtype=dtype)

    def optional(name: str) -> torch.Tensor | None:
        return take(name) if name in raw else None

    layers = []
    for i in range(spec.num_layers):
        p = f"model.layers.{i}."
        q, k, v = (take(p + f"self_attn.{n}_proj.weight") for n in "qkv")
        biases = [optional(p + f"self_attn.{n}_proj.bias") for n in "qkv"]
        layers.append(
            LayerWeights(
                input_norm=take(p + "input_layernorm.weight"),
                qkv=torch.cat((q, k, v), dim=0).t().contiguous(),
                qkv_bias=torch.cat(biases) if all(b is not None for b in biases) else None,
                q_norm=optional(p + "self_attn.q_norm.weight"),
                k_norm=optional(p + "self_attn.k_norm.weight"),
                o_proj=take(p + "self_attn.o_proj.weight").t().contiguous(),
                post_attention_norm=take(p + "post_attention_layernorm.weight"),
                gate_up=torch.cat(
                    (take(p + "mlp.gate_proj.weight"), take(p + "mlp.up_proj.weight")), dim=0
                ).t().contiguous(),
                down=take(p + "mlp.down_proj.weight").t().contiguous(),
            )
        )
    embed = take("model.embed_tokens.weight")
    lm_head = embed if spec.tie_word_embeddings or "lm_head.weight" not in raw else take("lm_head.weight")
    return ModelWeights(
        embed=embed,
        layers=layers,
        final_norm=take("model.norm.weight"),
        lm_head=lm_head.t().contiguous(),
    )
