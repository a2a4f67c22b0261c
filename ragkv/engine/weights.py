"""Model weights laid out for the forward loop: norms and embeddings as plain tensors in
the residual stream's dtype, every projection a `Linear` in the configured weight format.

q/k/v projections are fused into one matrix and gate/up into another so each layer does
two large matmuls instead of five small ones.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from ragkv.engine.linear import INT4_GROUP_SIZE, Int4Kernel, Linear
from ragkv.engine.model_files import INT4_BLOCKS_FILE
from ragkv.engine.model_spec import ModelSpec
from ragkv.engine.numerics import Numerics


@dataclass
class LayerWeights:
    input_norm: torch.Tensor
    qkv: Linear  # hidden -> (Hq + 2 Hkv) * D
    qkv_bias: torch.Tensor | None
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    o_proj: Linear  # Hq * D -> hidden
    post_attention_norm: torch.Tensor
    gate_up: Linear  # hidden -> 2 * intermediate
    down: Linear  # intermediate -> hidden
    pre_feedforward_norm: torch.Tensor | None = None
    """Gemma's four-norm layers: `post_attention_norm` then norms the attention output, this
    the MLP input and `post_feedforward_norm` the MLP output."""
    post_feedforward_norm: torch.Tensor | None = None


@dataclass
class ModelWeights:
    embed: torch.Tensor  # [vocab, hidden]
    layers: list[LayerWeights]
    final_norm: torch.Tensor
    lm_head: Linear  # hidden -> vocab


def weight_files(model_dir: Path) -> list[Path]:
    """The safetensors files that hold a model's weights, a GGUF's int4 blocks included (the
    fingerprint hashes these)."""
    blocks = [model_dir / INT4_BLOCKS_FILE] if (model_dir / INT4_BLOCKS_FILE).is_file() else []
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [model_dir / name for name in names] + blocks
    single = model_dir / "model.safetensors"
    if single.is_file():
        return [single] + blocks
    raise FileNotFoundError(f"no safetensors weights in {model_dir}")


def _read(path: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(path), framework="pt", device="cpu") as handle:
        return {name: handle.get_tensor(name) for name in handle.keys()}


def load_weights(model_dir: Path, spec: ModelSpec, numerics: Numerics, device: torch.device | str) -> ModelWeights:
    raw: dict[str, torch.Tensor] = {}
    int4_rows: dict[str, torch.Tensor] = {}
    for path in weight_files(model_dir):
        (int4_rows if path.name == INT4_BLOCKS_FILE else raw).update(_read(path))

    def take(name: str) -> torch.Tensor:
        if name not in raw:
            raise KeyError(f"weight {name!r} missing from {model_dir}")
        return raw[name].to(device=device, dtype=numerics.hidden_dtype)

    def optional(name: str) -> torch.Tensor | None:
        return take(name) if name in raw else None

    def norm(name: str) -> torch.Tensor:
        """A norm weight with the family's offset folded in (Gemma multiplies by 1 + w)."""
        if name not in raw:
            raise KeyError(f"weight {name!r} missing from {model_dir}")
        return (raw[name].float() + spec.norm_offset).to(device=device, dtype=numerics.hidden_dtype)

    def optional_norm(name: str) -> torch.Tensor | None:
        return norm(name) if name in raw else None

    def linear(*names: str, lm_head: bool = False) -> Linear:
        """The named [out, in] weights stacked along out, in float32 until quantized."""
        for name in names:
            if name not in raw:
                raise KeyError(f"weight {name!r} missing from {model_dir}")
        parts = [raw[name].to(device=device, dtype=torch.float32) for name in names]
        weight = torch.cat(parts)
        rows = None
        if (
            numerics.weights == "int4"
            and any(name in int4_rows for name in names)
            and weight.shape[1] % INT4_GROUP_SIZE == 0
        ):
            # the file's own blocks where it has them, the rest rounded as Int4Kernel does
            rows = torch.cat(
                [int4_rows[name] if name in int4_rows else Int4Kernel(part).rows for name, part in zip(names, parts)]
            )
        return Linear(weight, numerics, lm_head=lm_head, int4_rows=rows)

    layers = []
    for i in range(spec.num_layers):
        p = f"model.layers.{i}."
        biases = [optional(p + f"self_attn.{n}_proj.bias") for n in "qkv"]
        layers.append(
            LayerWeights(
                input_norm=norm(p + "input_layernorm.weight"),
                qkv=linear(*(p + f"self_attn.{n}_proj.weight" for n in "qkv")),
                qkv_bias=torch.cat(biases) if all(b is not None for b in biases) else None,
                q_norm=optional_norm(p + "self_attn.q_norm.weight"),
                k_norm=optional_norm(p + "self_attn.k_norm.weight"),
                o_proj=linear(p + "self_attn.o_proj.weight"),
                post_attention_norm=norm(p + "post_attention_layernorm.weight"),
                gate_up=linear(p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"),
                down=linear(p + "mlp.down_proj.weight"),
                pre_feedforward_norm=optional_norm(p + "pre_feedforward_layernorm.weight"),
                post_feedforward_norm=optional_norm(p + "post_feedforward_layernorm.weight"),
            )
        )
    tied = spec.tie_word_embeddings or "lm_head.weight" not in raw
    return ModelWeights(
        embed=take("model.embed_tokens.weight"),
        layers=layers,
        final_norm=norm("model.norm.weight"),
        lm_head=linear("model.embed_tokens.weight" if tied else "lm_head.weight", lm_head=True),
    )
