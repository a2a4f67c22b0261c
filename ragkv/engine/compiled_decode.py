"""A whole decode step in one compiled call, for the models and formats it covers.

The Python forward loop issues ~20 torch ops per layer; for one decode row each costs
more in dispatch than in arithmetic, and torch's packed int8 kernel runs well below the
memory limit on CPUs without bf16 units. The compiled step (`ragkv/kernels/cpu/decode_model.cpp`)
runs norms, int8 projections, RoPE, the cache append, batched attention and the MLP of
every layer without returning to Python. It covers Llama-style models (no q/k/v bias, no
q/k norms) with int8 or int4 decode weights, a float32 residual stream and a float32 or
bfloat16 cache on the CPU; everything else runs the Python loop. A request may decode with A2ATS
sparse attention (its selector's `compiled_plan`; other selectors run the Python loop).
Several rows of one request may share a cache in a step, each attending causally to the
rows before it: that is how a chat turn's few new tokens are prefilled (`extend`). The
Python loop is its reference (tests/test_compiled_decode.py).

The step is built from the model's spec and its weights (`DecodeWeights`, taken once from
the loaded `ModelWeights`), not from the forward loop's model object, and
`choose_decoder` is the one place that decides whether a model decodes through it.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from ragkv.engine.decode_weights import DecodeLayerWeights, DecodeWeights, PackedWeight
from ragkv.engine.kv_cache import KVCache
from ragkv.engine.linear import Linear
from ragkv.engine.model_spec import ModelSpec
from ragkv.engine.numerics import Numerics
from ragkv.engine.rope import Rotary
from ragkv.engine.weights import ModelWeights
from ragkv.kernels import cpu_extension, dispatch

log = logging.getLogger("ragkv.engine")

COMPILED_PREFILL_ROWS = 32
"""Prefills of up to this many rows after a cached prefix (a chat turn's new tokens) run
through the compiled step too, on the decode weights: for a few rows the step's few-row
kernels beat the Python loop, while past a few dozen rows the loop's GEMMs catch up."""


def unsupported_reason(
    spec: ModelSpec, weights: ModelWeights, numerics: Numerics, device: torch.device | str
) -> str | None:
    """Why the compiled step cannot run this model, or None when it can."""
    device = torch.device(device)
    if device.type != "cpu":
        return f"it runs on the CPU, the model is on {device.type}"
    if numerics.weights not in ("int8", "int4"):
        return f"it runs int8 or int4 decode weights, the model's are {numerics.weights}"
    if numerics.hidden_dtype != torch.float32 or numerics.kv_dtype not in cpu_extension.CACHE_DTYPES:
        return "it needs a float32 residual stream and a float32 or bfloat16 cache"
    if spec.sandwich_norms or spec.layer_types or spec.embed_scale != 1.0 or spec.hidden_act != "silu":
        # Gemma 3: its step would need q/k norms, four norms a layer, GELU, scaled
        # embeddings, a second RoPE table and a window per layer; the Python loop runs it
        return "Gemma-style layers (sandwich norms, GELU, scaled embeddings, sliding windows) are not covered"
    if any(layer.qkv_bias is not None or layer.q_norm is not None for layer in weights.layers):
        return "q/k/v biases and q/k norms are not covered"
    if not cpu_extension.supports_heads(spec.num_heads, spec.num_kv_heads, spec.head_dim):
        return (
            f"head_dim must be a multiple of 8 (<= {cpu_extension.MAX_HEAD_DIM}) and GQA groups at most "
            f"{cpu_extension.MAX_GROUP}"
        )
    if dispatch.compiled() is None:
        return "the compiled CPU kernels could not be built here"
    return None


def _packed(linear: Linear) -> PackedWeight:
    packed = linear.packed_decode_weight()
    if packed is None:
        raise TypeError("the compiled step needs int8 or int4 decode weights")
    return packed


def decode_weights(weights: ModelWeights) -> DecodeWeights:
    """The compiled step's view of loaded weights (every tensor shared, not copied)."""
    layers = tuple(
        DecodeLayerWeights(
            input_norm=layer.input_norm,
            qkv=_packed(layer.qkv),
            o_proj=_packed(layer.o_proj),
            post_attention_norm=layer.post_attention_norm,
            gate_up=_packed(layer.gate_up),
            down=_packed(layer.down),
        )
        for layer in weights.layers
    )
    return DecodeWeights(weights.embed.contiguous(), layers, weights.final_norm, _packed(weights.lm_head))


def choose_decoder(
    spec: ModelSpec, weights: ModelWeights, numerics: Numerics, device: torch.device | str
) -> CompiledDecoder | None:
    """The decode backend of a model: the compiled step where it covers the model, else
    None (the Python loop), saying why once in the log."""
    reason = unsupported_reason(spec, weights, numerics, device)
    if reason is not None:
        log.info("decode runs the Python loop: the compiled step does not apply (%s)", reason)
        return None
    return CompiledDecoder(spec, decode_weights(weights))


class CompiledDecoder:
    """The compiled step bound to one model's weights (shared, not copied); build it through
    `choose_decoder`, which checks that the step covers the model."""

    def __init__(self, spec: ModelSpec, weights: DecodeWeights):
        module = dispatch.compiled()
        if module is None:
            raise ValueError("the compiled CPU kernels could not be built here")
        self.spec, self.weights = spec, weights
        rotary = Rotary(spec.rope)  # float32 inv_freq, as the Python loop's float32 stream uses
        self._compiled = module.DecodeModel(
            layers=[layer.compiled(module) for layer in weights.layers],
            embed=weights.embed,
            final_norm=weights.final_norm,
            lm_head=weights.lm_head.compiled(module),
            inv_freq=rotary.inv_freq.contiguous(),
            attention_scaling=rotary.attention_scaling,
            heads=spec.num_heads,
            kv_heads=spec.num_kv_heads,
            head_dim=spec.head_dim,
            intermediate=spec.intermediate_size,
            eps=spec.rms_norm_eps,
            scale=spec.softmax_scale,
        )

    def step(
        self, token_ids: Sequence[int], caches: Sequence[KVCache], rows: Sequence[int], plans: Sequence = ()
    ) -> torch.Tensor:
        """Write each token's K/V at row rows[b] of caches[b] (room reserved, lengths set by
        the caller), attend over rows [0, rows[b]] and return logits [B, vocab]. plans: none,
        or one per request, None (dense) or a sparse selector's `compiled_plan`."""
        positions = [cache.next_position for cache in caches]
        return self._run(token_ids, positions, caches, rows, list(range(len(caches))), list(plans))

    def extend(self, token_ids: Sequence[int], cache: KVCache, start: int) -> torch.Tensor:
        """A short prefill: token j goes to row and position start + j (room reserved by
        the caller) and attends causally; returns the last token's logits [vocab]."""
        rows = list(range(start, start + len(token_ids)))
        return self._run(token_ids, rows, [cache] * len(rows), rows, [len(rows) - 1])[0]

    def _run(self, token_ids, positions, caches, rows, logit_rows, plans=()) -> torch.Tensor:
        # embedding and RoPE angles are computed inside the step: as a dozen torch ops their
        # Python dispatch was a visible share of a step, and a step leaves its caches cold
        return self._compiled.step(
            list(token_ids),
            list(positions),
            [cache.keys for cache in caches],
            [cache.values for cache in caches],
            list(rows),
            logit_rows,
            list(plans),
        )
