"""Batched k-means (Lloyd) with a bounded number of iterations.

Used by the A2ATS calibration (once, offline) and by PQCache (once per request after
the prefill), so it stays plain torch: B independent problems of N points in d
dimensions run as batched matmuls.
"""

from __future__ import annotations

import torch

_BLOCK = 4096


def nearest(points: torch.Tensor, centroids: torch.Tensor) -> torch.Tensor:
    """Index [B, N] (int64) of the nearest centroid [B, C, d] of each point [B, N, d]."""
    norms = centroids.pow(2).sum(-1).unsqueeze(1)  # [B, 1, C]
    out = torch.empty(points.shape[:2], dtype=torch.int64, device=points.device)
    for start in range(0, points.shape[1], _BLOCK):
        block = points[:, start : start + _BLOCK]
        # argmin |x - c|^2 = argmin |c|^2 - 2 x.c
        distances = torch.baddbmm(norms, block, centroids.transpose(1, 2), alpha=-2.0)
        out[:, start : start + _BLOCK] = distances.argmin(-1)
    return out


def kmeans(points: torch.Tensor, clusters: int, iterations: int, generator: torch.Generator | None = None
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """Fit `clusters` centroids to each of B point sets [B, N, d].

    Initialised from distinct random points (with repetition only when N < clusters);
    a cluster that empties is re-seeded at a random point. Returns (centroids [B, C, d],
    assignment [B, N] int64) after `iterations` Lloyd steps.
    """
    if points.dim() != 3:
        raise ValueError(f"points must be [B, N, d], got {tuple(points.shape)}")
    points = points.float()
    b, n, d = points.shape
    if n == 0:
        raise ValueError("k-means needs at least one point")
    if n >= clusters:
        init = torch.stack([torch.randperm(n, generator=generator)[:clusters] for _ in range(b)])
    else:
        init = torch.randint(n, (b, clusters), generator=generator)
    centroids = torch.gather(points, 1, init.unsqueeze(-1).expand(b, clusters, d)).clone()
    assignment = nearest(points, centroids)
    for _ in range(iterations):
        sums = torch.zeros_like(centroids).scatter_add_(1, assignment.unsqueeze(-1).expand(b, n, d), points)
        counts = torch.zeros((b, clusters), dtype=points.dtype, device=points.device)
        counts.scatter_add_(1, assignment, torch.ones_like(assignment, dtype=points.dtype))
        empty = counts == 0
        centroids = torch.where(empty.unsqueeze(-1), centroids, sums / counts.clamp(min=1).unsqueeze(-1))
        if empty.any() and n >= clusters:
            reseed = torch.randint(n, (b, clusters), generator=generator)
            fresh = torch.gather(points, 1, reseed.unsqueeze(-1).expand(b, clusters, d))
            centroids = torch.where(empty.unsqueeze(-1), fresh, centroids)
        assignment = nearest(points, centroids)
    return centroids, assignment
