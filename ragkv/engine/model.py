"""The forward loop over a decoder-only model's weights.

One loop serves ingestion (pre-RoPE K/V of a chunk), prefill, selective recompute (any
subset of rows against the whole cache) and decode (one row, optionally with a sparse
attention that reads selected cache rows). Nothing here patches transformers.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch
import torch.nn.functional as F
from transformers import AutoConfig

from ragkv.engine import pacing
from ragkv.engine.attention import causal_attention
from ragkv.engine.compiled_decode import COMPILED_PREFILL_ROWS, CompiledDecoder, choose_decoder
from ragkv.engine.kv_cache import KVCache
from ragkv.engine.model_spec import ModelSpec
from ragkv.engine.numerics import Numerics
from ragkv.engine.pass_cost import PassCost
from ragkv.engine.rope import Rotary
from ragkv.engine.weights import ModelWeights, load_weights
from ragkv.kernels.decode_attention import decode_attention as batched_decode_attention
from ragkv.kernels.rope import apply_rope


@dataclass
class Projection:
    """One layer's projections of some rows: q and k rotated to their positions, plus the
    pre-RoPE keys that the chunk store keeps."""

    q: torch.Tensor  # [Hq, N, D]
    k: torch.Tensor  # [Hkv, N, D]
    k_pre_rope: torch.Tensor  # [Hkv, N, D]
    v: torch.Tensor  # [Hkv, N, D]

    def of_rows(self, index: slice | torch.Tensor) -> Projection:
        """The projections of some of the rows (a slice or an index tensor)."""
        return Projection(self.q[:, index], self.k[:, index], self.k_pre_rope[:, index], self.v[:, index])


class DecodeAttention(Protocol):
    """Attention for one decode row; sparse selectors implement this to read fewer rows."""

    def __call__(self, layer: int, q: torch.Tensor, cache: KVCache, scale: float) -> torch.Tensor: ...


def compiled_plan(attention: DecodeAttention | None, cache: KVCache):
    """The compiled step's plan for a sparse attention (None: dense, or not compiled)."""
    method = getattr(attention, "compiled_plan", None)
    return None if method is None else method(cache)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    variance = x.pow(2).mean(-1, keepdim=True)
    return weight * (x * torch.rsqrt(variance + eps))


_ACTIVATIONS = {"silu": F.silu, "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh")}


class CausalLM:
    """`dtype` is the dtype of q/k/v, attention and the KV cache (what cache writers and
    sparse selectors see); `hidden_dtype` that of the residual stream. They differ when
    the numerics keep the stream in float32 and the cache in 16 bits."""

    def __init__(self, spec: ModelSpec, weights: ModelWeights, numerics: Numerics, device: torch.device | str):
        self.spec = spec
        self.weights = weights
        self.numerics = numerics
        self.dtype = numerics.kv_dtype
        self.hidden_dtype = numerics.hidden_dtype
        self.device = torch.device(device)
        self.rotary = Rotary(spec.rope, device=self.device, dtype=self.hidden_dtype)
        """The RoPE of the full-attention layers (every layer's but where `rotary_of` differs)."""
        local = None
        if spec.local_rope is not None:
            local = Rotary(spec.local_rope, device=self.device, dtype=self.hidden_dtype)
        self.rotaries = [
            self.rotary if local is None or spec.layer_window(i) is None else local for i in range(spec.num_layers)
        ]
        self.scale = spec.softmax_scale
        self.activation = _ACTIVATIONS[spec.hidden_act]
        self._embed_scale = torch.tensor(spec.embed_scale, dtype=self.hidden_dtype, device=self.device)
        self.compiled_decode = True
        """Run dense decode steps through the compiled step where it covers this model
        (ragkv.engine.compiled_decode); False keeps the Python loop (its reference)."""
        self._compiled_decoder: CompiledDecoder | None = None
        self._compiled_decoder_checked = False

    @classmethod
    def load(
        cls, model_dir: Path, dtype: torch.dtype = torch.float32, device: str = "cpu", numerics: Numerics | None = None
    ) -> CausalLM:
        """`numerics` overrides `dtype`, which alone means everything in that dtype."""
        numerics = numerics or Numerics.uniform(dtype)
        spec = ModelSpec.from_hf_config(AutoConfig.from_pretrained(model_dir))
        return cls(spec, load_weights(model_dir, spec, numerics, device), numerics, device)

    # -- building blocks -------------------------------------------------------------

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        rows = self.weights.embed[token_ids]
        return rows if self.spec.embed_scale == 1.0 else rows * self._embed_scale

    def rotary_of(self, layer: int) -> Rotary:
        """The RoPE of `layer` (Gemma 3's sliding-window layers use another base)."""
        return self.rotaries[layer]

    def rope_runs(self) -> list[tuple[slice, Rotary]]:
        """Runs of consecutive layers that share a RoPE, as slices (so a cache indexed by
        one is a view): one run for most families, six for Gemma 3's 5 local + 1 global
        pattern. Position recovery rotates each run's stored keys with its own base."""
        runs: list[tuple[slice, Rotary]] = []
        start = 0
        for layer in range(1, self.spec.num_layers + 1):
            if layer == self.spec.num_layers or self.rotaries[layer] is not self.rotaries[start]:
                runs.append((slice(start, layer), self.rotaries[start]))
                start = layer
        return runs

    def project(self, layer: int, hidden: torch.Tensor, positions: torch.Tensor) -> Projection:
        """Input norm and q/k/v projections of `hidden` [N, hidden] at `positions` [N]."""
        return self._project(layer, hidden, *self.rotary_of(layer).cos_sin(positions))

    def _project(self, layer: int, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> Projection:
        spec, w = self.spec, self.weights.layers[layer]
        x = rms_norm(hidden, w.input_norm, spec.rms_norm_eps)
        qkv = w.qkv(x)
        if w.qkv_bias is not None:
            qkv = qkv + w.qkv_bias
        n, d = hidden.shape[0], spec.head_dim
        q, k, v = qkv.split((spec.num_heads * d, spec.num_kv_heads * d, spec.num_kv_heads * d), dim=-1)
        q = q.view(n, spec.num_heads, d).transpose(0, 1)
        k = k.view(n, spec.num_kv_heads, d).transpose(0, 1)
        v = v.view(n, spec.num_kv_heads, d).transpose(0, 1)
        if w.q_norm is not None:
            q = rms_norm(q, w.q_norm, spec.rms_norm_eps)
            k = rms_norm(k, w.k_norm, spec.rms_norm_eps)
        kv_dtype = self.dtype
        return Projection(
            q=apply_rope(q, cos, sin).to(kv_dtype),
            k=apply_rope(k, cos, sin).to(kv_dtype),
            k_pre_rope=k.to(kv_dtype),
            v=v.to(kv_dtype),
        )

    def finish_layer(self, layer: int, hidden: torch.Tensor, attention_out: torch.Tensor) -> torch.Tensor:
        """o_proj + residual, then post-attention norm, MLP and residual. attention_out: [Hq, N, D].
        Gemma's layers norm the attention and MLP outputs before adding them (sandwich norms)."""
        w, eps = self.weights.layers[layer], self.spec.rms_norm_eps
        n = hidden.shape[0]
        attended = w.o_proj(attention_out.transpose(0, 1).reshape(n, -1).to(hidden.dtype))
        if w.pre_feedforward_norm is not None:
            hidden = hidden + rms_norm(attended, w.post_attention_norm, eps)
            gate, up = w.gate_up(rms_norm(hidden, w.pre_feedforward_norm, eps)).chunk(2, dim=-1)
            return hidden + rms_norm(w.down(self.activation(gate) * up), w.post_feedforward_norm, eps)
        hidden = hidden + attended
        x = rms_norm(hidden, w.post_attention_norm, eps)
        gate, up = w.gate_up(x).chunk(2, dim=-1)
        return hidden + w.down(self.activation(gate) * up)

    def finish_last_row(
        self,
        layer: int,
        hidden: torch.Tensor,
        projection: Projection,
        positions: torch.Tensor,
        cache: KVCache,
        rows: int,
    ) -> torch.Tensor:
        """`layer`'s output [1, hidden] for the last of the rows only: at the last layer only
        that row is read (the logits). The caller has written every row's K/V."""
        last = projection.of_rows(slice(-1, None))
        return self.finish_layer(layer, hidden[-1:], self.attend(layer, last, positions[-1:], cache, rows))

    def attend(
        self, layer: int, projection: Projection, positions: torch.Tensor, cache: KVCache, rows: int
    ) -> torch.Tensor:
        keys, values = cache.layer(layer, rows)
        window, first = self.spec.layer_window(layer), cache.first_row(layer)
        if first:  # released rows: positions count from the first held row
            positions = positions - first
        return causal_attention(projection.q, keys, values, positions, self.scale, window=window)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.weights.lm_head(rms_norm(hidden, self.weights.final_norm, self.spec.rms_norm_eps))

    @functools.cached_property
    def pass_cost(self) -> PassCost:
        """What its prompt rows cost at a context length (a step budget's weights)."""
        return PassCost.of(self.spec)

    def new_cache(self, capacity: int) -> KVCache:
        return KVCache.allocate(self.spec, capacity, self.dtype, self.device)

    # -- whole passes ----------------------------------------------------------------

    def layer_forward(
        self, layer: int, hidden: torch.Tensor, positions: torch.Tensor, cache: KVCache, rows: int
    ) -> torch.Tensor:
        """Run one layer for `hidden` rows at `positions`, writing their K/V into cache rows
        `positions` and attending to the first `rows` cache rows."""
        projection = self.project(layer, hidden, positions)
        cache.write(layer, positions, projection.k, projection.v)
        return self.finish_layer(layer, hidden, self.attend(layer, projection, positions, cache, rows))

    @torch.inference_mode()
    def prefill(self, token_ids: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """Append `token_ids` [N] to `cache` and return the logits of the last token [vocab].
        Under a pacer (ragkv.engine.pacing) the tokens go in pieces it sizes, pausing
        after each."""
        pacer = pacing.current()
        if pacer is None:
            return self._prefill(token_ids, cache)
        done, logits = 0, None
        while done < token_ids.numel():
            start = cache.length
            piece = token_ids[done : done + max(1, pacer.piece_tokens(start))]
            logits = self._prefill(piece, cache)
            done += piece.numel()
            pacer.spent(piece.numel(), start + piece.numel() / 2)
        if logits is None:
            return self._prefill(token_ids, cache)  # no tokens: what a whole prefill does
        return logits

    def _prefill(self, token_ids: torch.Tensor, cache: KVCache) -> torch.Tensor:
        start, n = cache.length, token_ids.numel()
        cache.reserve(start + n)
        decoder = self.compiled_decoder() if start > 0 and 0 < n <= COMPILED_PREFILL_ROWS else None
        if decoder is not None:
            logits = decoder.extend(token_ids.tolist(), cache, start)
            cache.length = cache.next_position = start + n
            return logits.to(self.hidden_dtype)
        positions = torch.arange(start, start + n, device=self.device)
        hidden = self.embed(token_ids.to(self.device))
        last = self.spec.num_layers - 1
        for layer in range(last):
            hidden = self.layer_forward(layer, hidden, positions, cache, start + n)
        # the last layer: every row's K/V, but only the last row's output (the logits)
        projection = self.project(last, hidden, positions)
        cache.write(last, positions, projection.k, projection.v)
        hidden = self.finish_last_row(last, hidden, projection, positions, cache, start + n)
        cache.length = cache.next_position = start + n
        return self.logits(hidden)[0]

    @torch.inference_mode()
    def chunk_kv(self, token_ids: torch.Tensor, prefix: KVCache | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Pre-RoPE keys and values [layers, kv_heads, N, D] of `token_ids` computed after
        `prefix` (whose rows are read, never modified)."""
        spec, n = self.spec, token_ids.numel()
        start = prefix.length if prefix is not None else 0
        cache = prefix.clone(extra_capacity=n) if prefix is not None else self.new_cache(n)
        positions = torch.arange(start, start + n, device=self.device)
        keys = torch.empty((spec.num_layers, spec.num_kv_heads, n, spec.head_dim), dtype=self.dtype, device=self.device)
        values = torch.empty_like(keys)
        hidden = self.embed(token_ids.to(self.device))
        for layer in range(spec.num_layers):
            projection = self.project(layer, hidden, positions)
            keys[layer], values[layer] = projection.k_pre_rope, projection.v
            cache.write(layer, positions, projection.k, projection.v)
            if layer + 1 < spec.num_layers:
                hidden = self.finish_layer(layer, hidden, self.attend(layer, projection, positions, cache, start + n))
        return keys, values

    @torch.inference_mode()
    def chunk_kv_many(
        self, chunks: Sequence[torch.Tensor], prefix: KVCache | None = None
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """`chunk_kv` of several chunks in one pass: their rows go through each weight matmul
        together (one projection and one MLP call per layer for all of them), while each
        chunk attends only to `prefix` and its own rows, as `chunk_kv` does one by one."""
        spec = self.spec
        start = prefix.length if prefix is not None else 0
        sizes = [chunk.numel() for chunk in chunks]
        caches = [prefix.clone(extra_capacity=n) if prefix is not None else self.new_cache(n) for n in sizes]
        positions = [torch.arange(start, start + n, device=self.device) for n in sizes]
        shape = (spec.num_layers, spec.num_kv_heads)
        out = [
            (
                torch.empty(shape + (n, spec.head_dim), dtype=self.dtype, device=self.device),
                torch.empty(shape + (n, spec.head_dim), dtype=self.dtype, device=self.device),
            )
            for n in sizes
        ]
        hidden = self.embed(torch.cat(list(chunks)).to(self.device))
        every_position = torch.cat(positions)
        for layer in range(spec.num_layers):
            projection = self.project(layer, hidden, every_position)
            attended, offset = [], 0
            for (keys, values), cache, at, n in zip(out, caches, positions, sizes):
                rows = slice(offset, offset + n)
                offset += n
                part = Projection(
                    projection.q[:, rows], projection.k[:, rows], projection.k_pre_rope[:, rows], projection.v[:, rows]
                )
                keys[layer], values[layer] = part.k_pre_rope, part.v
                cache.write(layer, at, part.k, part.v)
                if layer + 1 < spec.num_layers:
                    attended.append(self.attend(layer, part, at, cache, start + n))
            if layer + 1 < spec.num_layers:
                hidden = self.finish_layer(layer, hidden, torch.cat(attended, dim=1))
        return out

    @torch.inference_mode()
    def decode_step(
        self,
        token_id: int,
        cache: KVCache,
        attention: DecodeAttention | None = None,
        *,
        release_window_rows: bool = False,
    ) -> torch.Tensor:
        """Append one token and return next-token logits [vocab]."""
        return self.decode_batch([token_id], [cache], [attention], release_window_rows=release_window_rows)[0]

    @torch.inference_mode()
    def decode_batch(
        self,
        token_ids: Sequence[int],
        caches: Sequence[KVCache],
        attentions: Sequence[DecodeAttention | None] | None = None,
        *,
        release_window_rows: bool | Sequence[bool] = False,
    ) -> torch.Tensor:
        """Append one token to each of B requests and return their next-token logits [B, vocab].

        The B rows share every weight matmul and the dense requests one attention call
        (each over its own cache, own length and RoPE position); a request with a sparse
        attention runs its own. The compiled step runs the batch where it covers the model
        and every sparse attention in it gives a plan (A2ATS); otherwise the Python loop.

        `release_window_rows` (one for all or one per request): after the step, the
        sliding-window layers of each dense request's cache let go of rows no later token
        can see (KVCache.release_window_rows), so their KV stops growing; the cache can then
        no longer be cut before its window."""
        if len(token_ids) != len(caches):
            raise ValueError(f"{len(token_ids)} tokens for {len(caches)} caches")
        if attentions is None:
            attentions = [None] * len(caches)
        elif len(attentions) != len(caches):
            raise ValueError(f"{len(attentions)} attentions for {len(caches)} caches")
        if len({id(cache) for cache in caches}) != len(caches):
            raise ValueError("each request in a batch needs its own cache")
        rows = [cache.length for cache in caches]
        for cache, row in zip(caches, rows):
            cache.reserve(row + 1)
            cache.length = row + 1
        decoder = self.compiled_decoder()
        plans = (
            [] if decoder is None else [compiled_plan(attention, cache) for attention, cache in zip(attentions, caches)]
        )
        if decoder is not None and all(
            plan is not None or attention is None for plan, attention in zip(plans, attentions)
        ):
            logits = decoder.step(token_ids, caches, rows, plans)
            for cache in caches:
                cache.next_position += 1
            # a same-dtype .to() still pays a cold dispatch after the step; the dtype check is cheaper
            return logits if logits.dtype == self.hidden_dtype else logits.to(self.hidden_dtype)
        positions = torch.tensor([cache.next_position for cache in caches], device=self.device)
        tables = {id(rotary): rotary.cos_sin(positions) for rotary in {id(r): r for r in self.rotaries}.values()}
        hidden = self.embed(torch.tensor(list(token_ids), device=self.device))
        for layer in range(self.spec.num_layers):
            projection = self._project(layer, hidden, *tables[id(self.rotary_of(layer))])
            for b, (cache, row) in enumerate(zip(caches, rows)):
                cache.write(layer, row, projection.k[:, b], projection.v[:, b])
            queries = projection.q.transpose(0, 1)  # [B, Hq, D]
            # a sliding-window layer reads its window densely: the window is what a sparse
            # selector would narrow, and selectors rank rows over the whole cache
            layer_attentions = attentions if self.spec.layer_window(layer) is None else [None] * len(caches)
            dense = [b for b, attention in enumerate(layer_attentions) if attention is None]
            if len(dense) == len(caches):
                out = self._dense_decode(layer, queries, caches, [rows[b] + 1 for b in dense])
            else:
                out = torch.empty_like(queries)
                if dense:
                    out[dense] = self._dense_decode(
                        layer, queries[dense], [caches[b] for b in dense], [rows[b] + 1 for b in dense]
                    )
                for b, (cache, attention) in enumerate(zip(caches, layer_attentions)):
                    if attention is not None:
                        out[b] = attention(layer, projection.q[:, b : b + 1], cache, self.scale)[:, 0]
            hidden = self.finish_layer(layer, hidden, out.transpose(0, 1))
        for cache in caches:
            cache.next_position += 1
        releases = (
            [release_window_rows] * len(caches) if isinstance(release_window_rows, bool) else list(release_window_rows)
        )
        if self.spec.sliding_layers and any(releases):
            for cache, attention, release in zip(caches, attentions, releases):
                if release and attention is None:  # selectors rank and read rows of the whole cache
                    cache.release_window_rows(self.spec.sliding_layers, self.spec.sliding_window)
        return self.logits(hidden)

    def compiled_decoder(self) -> CompiledDecoder | None:
        """The compiled decode step for this model, built on first use; None where it does not apply."""
        if not self.compiled_decode:
            return None
        if not self._compiled_decoder_checked:
            self._compiled_decoder_checked = True
            self._compiled_decoder = choose_decoder(self.spec, self.weights, self.numerics, self.device)
        return self._compiled_decoder

    def _dense_decode(
        self, layer: int, queries: torch.Tensor, caches: Sequence[KVCache], lengths: list[int]
    ) -> torch.Tensor:
        """One attention call for every dense request of a step, each over its own cache; a
        sliding-window layer reads only its last `window` rows (views, nothing copied)."""
        window = self.spec.layer_window(layer)
        held = [cache.held(layer) for cache in caches]
        if window is None:
            return batched_decode_attention(
                queries, [keys for keys, _, _ in held], [values for _, values, _ in held], lengths, self.scale
            )
        # buffer row 0 is cache row `first` (after released rows), which the window never reaches before
        starts = [max(0, length - window) - first for length, (_, _, first) in zip(lengths, held)]
        if min(starts) < 0:
            raise RuntimeError(f"layer {layer}: its window reaches rows the cache released")
        return batched_decode_attention(
            queries,
            [keys[:, start:] for (keys, _, _), start in zip(held, starts)],
            [values[:, start:] for (_, values, _), start in zip(held, starts)],
            [length - first - start for length, (_, _, first), start in zip(lengths, held, starts)],
            self.scale,
        )
