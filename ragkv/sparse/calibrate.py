"""Build an A2ATS codebook for a model from calibration text (`ragkv calibrate`).

The text (user files and/or documents already ingested) is mixed with random UUID
strings (high-entropy tokens whose keys plain prose never produces) and run through the
model in sequences, each after the engine's chunk precompute prefix, as chunks are at
ingestion. Per layer and KV head this collects the pre-RoPE keys, their mean, and the
second moment of the WRoPE queries (rotated to relative position b) pooled over the
head's GQA group (each query head is scored on its own); the Cholesky factor of that
moment is the distance transform, and k-means in the transformed key space gives the
centroids (k-means is translation invariant, so the same codes serve the mean-centred
residual the selector scores).
"""

from __future__ import annotations

import random
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from ragkv.engine.model import CausalLM
from ragkv.sparse.codebook import A2ATSCodebook
from ragkv.sparse.kmeans import kmeans


@dataclass(frozen=True)
class CalibrationConfig:
    codebook_size: int = 1024
    """Centroids per layer and KV head (C)."""
    offset: int = 2048
    """WRoPE b."""
    tokens: int = 8192
    """Calibration tokens in all (text plus UUID strings)."""
    uuid_share: float = 0.1
    """Share of the calibration tokens that are random UUID strings."""
    sequence_tokens: int = 1024
    """Tokens per calibration sequence (each runs after the chunk precompute prefix)."""
    iterations: int = 12
    """k-means iterations."""
    max_keys: int = 16384
    """At most this many keys per layer and KV head train the k-means."""
    ridge: float = 1e-3
    """Added to the query second moment, relative to its mean eigenvalue (keeps L invertible)."""
    seed: int = 0

    def __post_init__(self) -> None:
        if not 2 <= self.codebook_size <= 32767:
            raise ValueError("codebook_size must be in [2, 32767]")
        if self.tokens < 16 or self.sequence_tokens < 16:
            raise ValueError("tokens and sequence_tokens must be >= 16")
        if not 0.0 <= self.uuid_share <= 1.0:
            raise ValueError("uuid_share must be in [0, 1]")
        if self.iterations < 1 or self.max_keys < 2 or self.offset < 0 or self.ridge < 0:
            raise ValueError("iterations >= 1, max_keys >= 2, offset >= 0 and ridge >= 0 are required")


def uuid_text(count: int, seed: int) -> str:
    rng = random.Random(seed)
    return "\n".join(str(uuid.UUID(int=rng.getrandbits(128), version=4)) for _ in range(count))


def calibration_sequences(
    encode: Callable[[str], list[int]], texts: Sequence[str], config: CalibrationConfig
) -> list[list[int]]:
    """Token sequences of at most `sequence_tokens`: the texts' tokens (cycled if short)
    up to (1 - uuid_share) of the total, then UUID strings for the rest."""
    text_budget = int(round(config.tokens * (1 - config.uuid_share)))
    text_ids: list[int] = []
    for text in texts:
        text_ids.extend(encode(text))
    if not text_ids and text_budget:
        raise ValueError("calibration needs some text: give files or ingest documents first")
    stream = (text_ids * (text_budget // max(len(text_ids), 1) + 1))[:text_budget] if text_ids else []
    uuid_budget = config.tokens - len(stream)
    uuid_ids: list[int] = []
    count = 64
    while uuid_budget and len(uuid_ids) < uuid_budget:
        uuid_ids = encode(uuid_text(count, config.seed))
        count *= 2
    size = config.sequence_tokens
    pieces = [stream[i : i + size] for i in range(0, len(stream), size)]
    pieces += [uuid_ids[:uuid_budget][i : i + size] for i in range(0, uuid_budget, size)]
    return [piece for piece in pieces if len(piece) >= 2]


@torch.inference_mode()
def collect(
    model: CausalLM,
    sequences: Sequence[list[int]],
    prefix_ids: Sequence[int],
    offset: int,
    progress: Callable[[str], None] = lambda message: None,
) -> tuple[list[torch.Tensor], torch.Tensor, int]:
    """Pre-RoPE keys per layer ([Hkv, N, D] each) of the sequences' tokens, and the WRoPE
    query second moments pooled over each GQA group [layers, Hkv, D, D] (sums over N
    positions, averaged over the group's heads)."""
    spec = model.spec
    keys: list[list[torch.Tensor]] = [[] for _ in range(spec.num_layers)]
    moments = torch.zeros((spec.num_layers, spec.num_kv_heads, spec.head_dim, spec.head_dim), dtype=torch.float64)
    count = 0
    for number, sequence in enumerate(sequences, start=1):
        progress(f"calibration sequence {number}/{len(sequences)}")
        ids = torch.tensor(list(prefix_ids) + list(sequence))
        n, skip = ids.numel(), len(prefix_ids)
        cache = model.new_cache(n)
        positions = torch.arange(n, device=model.device)
        hidden = model.embed(ids.to(model.device))
        for layer in range(spec.num_layers):
            projection = model.project(layer, hidden, positions)
            cache.keys[layer, :, positions] = projection.k
            cache.values[layer, :, positions] = projection.v
            keys[layer].append(projection.k_pre_rope[:, skip:].float().cpu())
            # R(b - p) q_post = R(b) q_pre, then the GQA group sum the selector uses.
            wrope = model.rotary_of(layer).rotate(projection.q[:, skip:], offset - positions[skip:])
            pooled = wrope.double().reshape(spec.num_kv_heads, spec.group_size * (n - skip), spec.head_dim)
            moments[layer] += torch.einsum("hnd,hne->hde", pooled, pooled).cpu() / spec.group_size
            if layer + 1 < spec.num_layers:
                hidden = model.finish_layer(layer, hidden, model.attend(layer, projection, positions, cache, n))
        count += n - skip
    return [torch.cat(layer_keys, dim=1) for layer_keys in keys], moments, count


def fit_codebook(
    keys: list[torch.Tensor],
    moments: torch.Tensor,
    count: int,
    config: CalibrationConfig,
    progress: Callable[[str], None] = lambda message: None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(centroids [layers, Hkv, C, D], transform [layers, Hkv, D, D]) by query-aware k-means."""
    generator = torch.Generator().manual_seed(config.seed)
    dim = moments.shape[-1]
    second = moments / max(count, 1)
    mean_eigen = second.diagonal(dim1=-2, dim2=-1).mean(-1, keepdim=True).unsqueeze(-1)
    eye = torch.eye(dim, dtype=second.dtype)
    transform = torch.linalg.cholesky(second + (config.ridge * mean_eigen + 1e-12) * eye).float()  # S = L L^T
    centroids = []
    for layer, layer_keys in enumerate(keys):
        progress(f"k-means layer {layer + 1}/{len(keys)}")
        if layer_keys.shape[1] > config.max_keys:
            sample = torch.randperm(layer_keys.shape[1], generator=generator)[: config.max_keys]
            layer_keys = layer_keys[:, sample]
        mapped = layer_keys @ transform[layer]  # x = k L: |x - c L|^2 = (k - c)^T S (k - c)
        fitted, _ = kmeans(mapped, config.codebook_size, config.iterations, generator)
        # back to key space: c = (c L) L^-1
        centroids.append(torch.linalg.solve_triangular(transform[layer], fitted, upper=False, left=False))
    return torch.stack(centroids), transform


def calibrate(
    model: CausalLM,
    encode: Callable[[str], list[int]],
    texts: Sequence[str],
    prefix_ids: Sequence[int] = (),
    config: CalibrationConfig = CalibrationConfig(),
    progress: Callable[[str], None] = lambda message: None,
) -> A2ATSCodebook:
    started = time.perf_counter()
    sequences = calibration_sequences(encode, texts, config)
    keys, moments, count = collect(model, sequences, prefix_ids, config.offset, progress)
    centroids, transform = fit_codebook(keys, moments, count, config, progress)
    key_mean = torch.stack([layer_keys.mean(1) for layer_keys in keys])
    info = {
        "tokens": str(count),
        "sequences": str(len(sequences)),
        "uuid_share": str(config.uuid_share),
        "iterations": str(config.iterations),
        "seconds": f"{time.perf_counter() - started:.1f}",
    }
    return A2ATSCodebook(centroids, transform, config.offset, key_mean, info)
