"""The geometry of a decoder-only checkpoint, read once from its Hugging Face config.

The forward loop in `ragkv.engine.model` is written against this spec rather than against
transformers' model classes, so every supported family is one set of fields.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

SUPPORTED_FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma3_text")
SUPPORTED_ACTIVATIONS = ("silu", "gelu_pytorch_tanh")
LAYER_TYPES = ("full_attention", "sliding_attention")


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
    layer_types: tuple[str, ...] = ()
    """Per layer "full_attention" or "sliding_attention" (Gemma 3); empty: every layer full."""
    sliding_window: int | None = None
    """Keys a sliding-window layer's query sees, itself included (positions p - window + 1 .. p)."""
    local_rope: RopeSpec | None = None
    """RoPE of the sliding-window layers where it differs from `rope` (Gemma 3: base 10,000
    locally, 1,000,000 in the full layers)."""
    embed_scale: float = 1.0
    """Embeddings are multiplied by this before layer 0 (Gemma: sqrt(hidden)); the tied LM
    head reads the unscaled matrix."""
    attention_scale: float | None = None
    """Softmax scale of q.k; None: 1/sqrt(head_dim) (Gemma: query_pre_attn_scalar ** -0.5)."""
    norm_offset: float = 0.0
    """RMSNorm multiplies by (offset + weight): Gemma stores weights around zero and uses 1."""
    sandwich_norms: bool = False
    """Gemma: the attention output and the MLP output are normed before their residual adds,
    and the MLP input has its own norm (four norms per layer)."""

    def __post_init__(self) -> None:
        if self.family not in SUPPORTED_FAMILIES:
            raise ValueError(f"unsupported model family {self.family!r}; ragkv supports {SUPPORTED_FAMILIES}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"{self.num_heads} query heads do not group evenly over {self.num_kv_heads} KV heads")
        if self.hidden_act not in SUPPORTED_ACTIVATIONS:
            raise ValueError(f"unsupported activation {self.hidden_act!r}; supported: {SUPPORTED_ACTIVATIONS}")
        if self.layer_types and len(self.layer_types) != self.num_layers:
            raise ValueError(f"{len(self.layer_types)} layer types for {self.num_layers} layers")
        unknown = set(self.layer_types) - set(LAYER_TYPES)
        if unknown:
            raise ValueError(f"unsupported layer types {sorted(unknown)}; supported: {LAYER_TYPES}")
        if "sliding_attention" in self.layer_types and not (self.sliding_window and self.sliding_window > 0):
            raise ValueError("sliding-window layers need a positive sliding_window")

    def layer_window(self, layer: int) -> int | None:
        """The sliding window of `layer`, or None when it attends to every earlier row."""
        if self.layer_types and self.layer_types[layer] == "sliding_attention":
            return self.sliding_window
        return None

    @property
    def sliding_layers(self) -> tuple[int, ...]:
        return tuple(layer for layer in range(self.num_layers) if self.layer_window(layer) is not None)

    def layer_rope(self, layer: int) -> RopeSpec:
        """The RoPE of `layer`: the local one for sliding-window layers where the model has one."""
        if self.local_rope is not None and self.layer_window(layer) is not None:
            return self.local_rope
        return self.rope

    @property
    def softmax_scale(self) -> float:
        return self.attention_scale if self.attention_scale is not None else 1.0 / math.sqrt(self.head_dim)

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
            **self._gemma_fingerprint_fields(),
        }

    def _gemma_fingerprint_fields(self) -> dict[str, Any]:
        """Fields only Gemma-style models set; absent for the others so their fingerprints
        (and stored chunks) stay as they were. The window changes a chunk's KV; the scale
        and norms change every layer's output."""
        if not (self.layer_types or self.sandwich_norms or self.embed_scale != 1.0):
            return {}
        return {
            "layer_types": list(self.layer_types),
            "window": self.sliding_window,
            "embed_scale": self.embed_scale,
            "attention_scale": self.attention_scale,
            "norm_offset": self.norm_offset,
            "sandwich_norms": self.sandwich_norms,
            "act": self.hidden_act,
        }

    @classmethod
    def from_hf_config(cls, config: Any) -> ModelSpec:
        family = config.model_type
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        rope_parameters = dict(getattr(config, "rope_parameters", None) or {})
        if not rope_parameters:
            rope_parameters = dict(getattr(config, "rope_scaling", None) or {})
            rope_parameters.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
        local_rope = None
        if "full_attention" in rope_parameters:  # per layer type (Gemma 3)
            local_rope = _rope_spec(dict(rope_parameters["sliding_attention"]), head_dim, config)
            rope_parameters = dict(rope_parameters["full_attention"])
        gemma = family == "gemma3_text"
        if gemma:
            for name in ("final_logit_softcapping", "attn_logit_softcapping"):
                if getattr(config, name, None) is not None:
                    raise ValueError(f"{name} is not supported")
            if getattr(config, "use_bidirectional_attention", False):
                raise ValueError("bidirectional attention is not supported (ragkv runs causal decoders)")
        layer_types = tuple(getattr(config, "layer_types", None) or ())
        uses_window = "sliding_attention" in layer_types
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
            qk_norm=family in ("qwen3", "gemma3_text"),
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            hidden_act=getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", "silu"),
            rope=_rope_spec(rope_parameters, head_dim, config),
            bos_token_id=getattr(config, "bos_token_id", None),
            eos_token_ids=eos_ids,
            layer_types=layer_types if uses_window else (),
            sliding_window=config.sliding_window if uses_window else None,
            local_rope=local_rope,
            embed_scale=math.sqrt(config.hidden_size) if gemma else 1.0,
            attention_scale=config.query_pre_attn_scalar**-0.5 if gemma else None,
            norm_offset=1.0 if gemma else 0.0,
            sandwich_norms=gemma,
        )


def _rope_spec(parameters: dict[str, Any], head_dim: int, config: Any) -> RopeSpec:
    parameters = dict(parameters)
    rope_type = parameters.pop("rope_type", None) or parameters.pop("type", None) or "default"
    return RopeSpec(
        rope_type=rope_type,
        theta=float(parameters.pop("rope_theta")),
        head_dim=head_dim,
        max_position_embeddings=config.max_position_embeddings,
        params=parameters,
    )
