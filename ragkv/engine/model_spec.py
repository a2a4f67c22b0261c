"""The geometry of a decoder-only checkpoint, read once from its Hugging Face config.

The forward loop in `ragkv.engine.model` is written against this spec rather than against
transformers' model classes, so every supported family is one set of fields.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

SUPPORTED_FAMILIES = ("llama", "mistral", "qwen2", "qwen3")


@dataclass(frozen=True)
class RopeSpec:
    """RoPE parameters as the checkpoint declares them (`rope_parameters` in transformers 5)."""

    rope_type: str
    theta: float
    head_dim: int
    max_position_embeddings: int
    params: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class ModelSpec:
    family: str
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    qkv_bias: bool
    qk_norm: bool
    tie_word_embeddings: bool
    hidden_act: str
    rope: RopeSpec
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]

    def __post_init__(self) -> None:
        if self.family not in SUPPORTED_FAMILIES:
            raise ValueError(f"unsupported model family {self.family!r}; ragkv supports {SUPPORTED_FAMILIES}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"{self.num_heads} query heads do not group evenly over {self.num_kv_heads} KV heads")
        if self.hidden_act != "silu":
            raise ValueError(f"unsupported activation {self.hidden_act!r} (the supported families use silu)")

    @property
    def group_size(self) -> int:
        """Query heads per KV head (GQA)."""
        return self.num_heads // self.num_kv_heads

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of K and V per token across all layers at 2 bytes per element (fp16 storage)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * 2

    def fingerprint_fields(self) -> dict[str, Any]:
        """Fields that change a chunk's pre-RoPE KV. RoPE is left out on purpose: keys are
        stored before rotation, so a RoPE-scaling change does not invalidate stored chunks."""
        return {
            "family": self.family,
            "layers": self.num_layers,
            "hidden": self.hidden_size,
            "intermediate": self.intermediate_size,
            "heads": self.num_heads,
            "kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "vocab": self.vocab_size,
            "eps": self.rms_norm_eps,
            "qkv_bias": self.qkv_bias,
            "qk_norm": self.qk_norm,
        }

    @classmethod
    def from_hf_config(cls, config: Any) -> "ModelSpec":
        family = config.model_type
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        rope_parameters = dict(getattr(config, "rope_parameters", None) or {})
        if not rope_parameters:
            rope_parameters = dict(getattr(config, "rope_scaling", None) or {})
            rope_parameters.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
        rope_type = rope_parameters.pop("rope_type", None) or rope_parameters.pop("type", None) or "default"
        theta = float(rope_parameters.pop("rope_theta"))
        eos = config.eos_token_id
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else ((eos,) if eos is not None else ())
        return cls(
            family=family,
            num_layers=config.num_hidden_layers,
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            num_heads=config.num_attention_heads,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
            head_dim=head_dim,
            vocab_size=config.vocab_size,
            rms_norm_eps=float(config.rms_norm_eps),
            qkv_bias=bool(getattr(config, "attention_bias", family == "qwen2")),
            qk_norm=family == "qwen3",
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            hidden_act=getattr(config, "hidden_act", "silu"),
            rope=RopeSpec(
                rope_type=rope_type,
                theta=theta,
                head_dim=head_dim,
                max_position_embeddings=config.max_position_embeddings,
                params=rope_parameters,
            ),
            bos_token_id=getattr(config, "bos_token_id", None),
            eos_token_ids=eos_ids,
        )
