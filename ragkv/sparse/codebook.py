"""The A2ATS codebook: one shared, query-aware VQ codebook per layer and KV head over
pre-RoPE keys.

Query-aware VQ minimises the error of the attention score rather than of the key:
E_q[(q.k - q.c)^2] = (k - c)^T S (k - c) with S = E[q q^T] the second moment of the
(WRoPE-rotated, pooled over the KV head's GQA group) queries. With S = L L^T (Cholesky), that is
|(k - c) L|^2, so keys are clustered in the space x = k L and centroids mapped back.

Because the keys are pre-RoPE, a chunk's codes do not depend on where the chunk lands in
a prompt: ingestion computes them once and stores them with the chunk's KV.

Staleness: a chunk records the id (content hash) of the codebook its codes were made
with ("codebook_id"), and codes are used only when that id equals the active
codebook's; otherwise they are recomputed from the chunk's stored keys at query time. The
id is deliberately NOT part of the chunk key fingerprint: the KV does not depend on the
codebook, so recalibrating must not turn every stored chunk into a miss and force its KV
to be recomputed; only the small codes go stale, and they are checked per chunk.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import torch

CODES_KEY = "codes"
CODEBOOK_ID_KEY = "codebook_id"
_ID_BYTES = 16
_BLOCK = 2048


@dataclass(frozen=True, eq=False)
class ScoringCentroids:
    """Centroids rounded to int8 with one float32 scale each (symmetric, the largest
    coordinate at +-127). The step's A2ATS tables are bound by streaming the centroids
    from DRAM, so half the bytes of float16 makes them faster (BENCHMARKS.md)."""

    codes: torch.Tensor
    """[layers, kv_heads, C, D] int8."""
    scales: torch.Tensor
    """[layers, kv_heads, C] float32."""

    @classmethod
    def rounded(cls, centroids: torch.Tensor) -> ScoringCentroids:
        scales = centroids.abs().amax(-1).float() / 127
        safe = torch.where(scales > 0, scales, torch.ones_like(scales))
        codes = torch.round(centroids.float() / safe.unsqueeze(-1)).clamp(-127, 127).to(torch.int8)
        return cls(codes, scales)

    def values(self) -> torch.Tensor:
        """[layers, kv_heads, C, D] float32: the centroids as the scores see them."""
        return self.codes.float() * self.scales.unsqueeze(-1)


@dataclass(eq=False)
class A2ATSCodebook:
    centroids: torch.Tensor
    """[layers, kv_heads, C, D] float32, in pre-RoPE key space."""
    transform: torch.Tensor
    """[layers, kv_heads, D, D] float32, lower-triangular L with L L^T = E[q q^T] (distance transform)."""
    offset: int = 2048
    """WRoPE b: the query is rotated to relative position b for keys outside the window."""
    key_mean: torch.Tensor | None = None
    """[layers, kv_heads, D] mean pre-RoPE key of the calibration text (scored with exact
    RoPE by the selector; None = zeros)."""
    info: dict[str, str] = field(default_factory=dict)
    """Free-form provenance (calibration sources, token counts)."""
    _derived: dict = field(default_factory=dict, init=False, repr=False)
    """What `derived` built from this codebook, by key."""

    def __post_init__(self) -> None:
        if self.centroids.dim() != 4 or self.transform.dim() != 4:
            raise ValueError("centroids must be [layers, kv_heads, C, D] and transform [layers, kv_heads, D, D]")
        layers, heads, size, dim = self.centroids.shape
        if self.transform.shape != (layers, heads, dim, dim):
            raise ValueError("transform must be [layers, kv_heads, D, D] matching the centroids")
        if not 2 <= size <= 32767:
            raise ValueError("a codebook holds 2..32767 centroids (codes are int16)")
        self.centroids = self.centroids.float().contiguous()
        self.transform = self.transform.float().contiguous()
        if self.key_mean is None:
            self.key_mean = self.centroids.new_zeros((layers, heads, dim))
        if self.key_mean.shape != (layers, heads, dim):
            raise ValueError("key_mean must be [layers, kv_heads, D] matching the centroids")
        self.key_mean = self.key_mean.float().contiguous()

    @property
    def size(self) -> int:
        return self.centroids.shape[2]

    @property
    def shape(self) -> tuple[int, int, int]:
        """(layers, kv_heads, head_dim) the codebook was built for."""
        layers, heads, _, dim = self.centroids.shape
        return layers, heads, dim

    @cached_property
    def id(self) -> str:
        """Content hash: changes whenever the centroids, the transform, the mean key or b change."""
        digest = hashlib.blake2b(digest_size=_ID_BYTES)
        digest.update(str(self.offset).encode())
        for tensor in (self.centroids, self.transform, self.key_mean):
            digest.update(str(tuple(tensor.shape)).encode())
            digest.update(tensor.detach().cpu().numpy().tobytes())
        return digest.hexdigest()

    @cached_property
    def _transformed(self) -> tuple[torch.Tensor, torch.Tensor]:
        mapped = self.centroids @ self.transform  # c L: [layers, kv_heads, C, D]
        return mapped, mapped.pow(2).sum(-1)

    def scoring_centroids(self, mean_key: bool) -> ScoringCentroids:
        """The centroids the A2ATS scores use, less the key mean when its term is scored
        exactly (mean_key), rounded to int8 once and kept: the compiled decode step streams
        them every step (a quarter of float32's bytes), and the Python reference uses the
        same values."""

        def build() -> ScoringCentroids:
            centroids = self.centroids - self.key_mean.unsqueeze(2) if mean_key else self.centroids
            return ScoringCentroids.rounded(centroids)

        return self.derived(("scoring centroids", mean_key), build)

    def derived(self, key: tuple, build: Callable[[], Any]) -> Any:
        """build(), made once per key and kept with the codebook: the layouts and copies that
        every request using it shares (scoring centroids, kernel tiles, device copies)."""
        if key not in self._derived:
            self._derived[key] = build()
        return self._derived[key]

    def check_model(self, spec) -> None:
        if self.shape != (spec.num_layers, spec.num_kv_heads, spec.head_dim):
            raise ValueError(
                f"the A2ATS codebook was built for (layers, kv_heads, head_dim) = {self.shape}, "
                f"the model has {(spec.num_layers, spec.num_kv_heads, spec.head_dim)}"
            )

    def on(self, device: torch.device | str) -> A2ATSCodebook:
        """This codebook with its tensors on `device` (the copy is made once and kept)."""
        device = torch.device(device)
        if self.centroids.device == device:
            return self
        return self.derived(
            ("device copy", device),
            lambda: A2ATSCodebook(
                self.centroids.to(device),
                self.transform.to(device),
                self.offset,
                self.key_mean.to(device),
                dict(self.info),
            ),
        )

    # -- encoding ------------------------------------------------------------------------

    def encode_layer(self, layer: int, keys: torch.Tensor) -> torch.Tensor:
        """Codes [Hkv, n] int16 of pre-RoPE keys [Hkv, n, D] at `layer`."""
        mapped, norms = self._transformed
        transform = self.transform[layer].to(keys.device)
        mapped, norms = mapped[layer].to(keys.device), norms[layer].to(keys.device).unsqueeze(1)
        codes = torch.empty(keys.shape[:2], dtype=torch.int16, device=keys.device)
        for start in range(0, keys.shape[1], _BLOCK):
            x = keys[:, start : start + _BLOCK].float() @ transform
            # argmin |x - c|^2 = argmax 2 x.c - |c|^2
            scores = torch.baddbmm(norms, x, mapped.transpose(1, 2), alpha=2.0, beta=-1.0)
            codes[:, start : start + _BLOCK] = scores.argmax(-1).to(torch.int16)
        return codes

    def encode(self, keys: torch.Tensor) -> torch.Tensor:
        """Codes [layers, Hkv, n] int16 of pre-RoPE keys [layers, Hkv, n, D]."""
        return torch.stack([self.encode_layer(layer, keys[layer]) for layer in range(keys.shape[0])])

    def chunk_tensors(self, keys: torch.Tensor) -> dict[str, torch.Tensor]:
        """What a stored chunk carries: its codes and the id of this codebook."""
        return {CODES_KEY: self.encode(keys).contiguous(), CODEBOOK_ID_KEY: self.id_tensor()}

    def id_tensor(self) -> torch.Tensor:
        return torch.frombuffer(bytearray(bytes.fromhex(self.id)), dtype=torch.uint8).clone()

    def codes_of(self, tensors: dict[str, torch.Tensor] | None) -> torch.Tensor | None:
        """A stored chunk's codes when they were made with this codebook, else None."""
        if not tensors or CODES_KEY not in tensors or CODEBOOK_ID_KEY not in tensors:
            return None
        if bytes(tensors[CODEBOOK_ID_KEY].cpu().numpy().tobytes()).hex() != self.id:
            return None
        return tensors[CODES_KEY]

    # -- serialisation (the application layer stores these; see ragkv.app.codebooks) ------

    def to_tensors(self) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
        metadata = {"offset": str(self.offset), "id": self.id, "info": json.dumps(self.info, sort_keys=True)}
        tensors = {
            "centroids": self.centroids.cpu(),
            "transform": self.transform.cpu(),
            "key_mean": self.key_mean.cpu(),
        }
        return tensors, metadata

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> A2ATSCodebook:
        codebook = cls(
            tensors["centroids"].clone(),
            tensors["transform"].clone(),
            int(metadata["offset"]),
            tensors["key_mean"].clone() if "key_mean" in tensors else None,
            json.loads(metadata.get("info", "{}")),
        )
        if codebook.id != metadata.get("id"):
            raise ValueError("stored codebook id does not match its content")
        return codebook
