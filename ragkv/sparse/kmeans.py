"""Batched k-means (Lloyd) with a bounded number of iterations.

Used by the A2ATS calibration (once, offline) and by PQCache (once per request after
the prefill), so it stays plain torch: B independent problems of N points in d
dimensions run as batched matmuls.
"""

from __future__ import annotations

import torch

_BLOCK = 4096
_SEED_POOL = 8


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


def kmeans_plus_plus(points: torch.Tensor, clusters: int, generator: torch.Generator | None = None) -> torch.Tensor:
    """k-means++ seeding: initial centroids [B, C, d], each drawn with probability
    proportional to its squared distance from the ones already chosen."""
    b, n, d = points.shape
    # random draws come from `generator` (a CPU generator: the same seed picks the same
    # points on every device) and then move to the points' device
    batch = torch.arange(b, device=points.device)
    first = torch.randint(n, (b,), generator=generator).to(points.device)
    centroids = points.new_empty((b, clusters, d))
    centroids[:, 0] = points[batch, first]
    norms = points.pow(2).sum(-1)  # [B, N]

    def distance_to(centroid: torch.Tensor) -> torch.Tensor:  # [B, d] -> squared distances [B, N]
        return norms - 2 * torch.bmm(points, centroid.unsqueeze(-1)).squeeze(-1) + centroid.pow(2).sum(-1, keepdim=True)

    closest = distance_to(centroids[:, 0])
    for index in range(1, clusters):
        weights = closest.clamp(min=0)
        empty = weights.sum(-1) <= 0  # every point already a centroid (N < C): repeat one
        weights = torch.where(empty.unsqueeze(1), torch.ones_like(weights), weights)
        # inverse-CDF draw (torch.multinomial is far slower on long CPU rows)
        cumulative = weights.double().cumsum(-1)
        target = torch.rand((b, 1), generator=generator, dtype=torch.float64).to(points.device) * cumulative[:, -1:]
        chosen = torch.searchsorted(cumulative, target).squeeze(1).clamp(max=n - 1)
        centroids[:, index] = points[batch, chosen]
        closest = torch.minimum(closest, distance_to(centroids[:, index]))
    return centroids


def kmeans(
    points: torch.Tensor, clusters: int, iterations: int, generator: torch.Generator | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fit `clusters` centroids to each of B point sets [B, N, d].

    k-means++ seeding (from at most 8 C random points), then `iterations` Lloyd steps; a cluster that empties keeps its
    centroid. Returns (centroids [B, C, d], assignment [B, N] int64).
    """
    if points.dim() != 3:
        raise ValueError(f"points must be [B, N, d], got {tuple(points.shape)}")
    points = points.float()
    b, n, d = points.shape
    if n == 0:
        raise ValueError("k-means needs at least one point")
    seeds = points
    if n > _SEED_POOL * clusters:  # seed from a random subset: k-means++ is sequential in C
        seeds = points[:, torch.randperm(n, generator=generator)[: _SEED_POOL * clusters].to(points.device)]
    centroids = kmeans_plus_plus(seeds, clusters, generator)
    assignment = nearest(points, centroids)
    for _ in range(iterations):
        sums = torch.zeros_like(centroids).scatter_add_(1, assignment.unsqueeze(-1).expand(b, n, d), points)
        counts = torch.zeros((b, clusters), dtype=points.dtype, device=points.device)
        counts.scatter_add_(1, assignment, torch.ones_like(assignment, dtype=points.dtype))
        centroids = torch.where((counts == 0).unsqueeze(-1), centroids, sums / counts.clamp(min=1).unsqueeze(-1))
        assignment = nearest(points, centroids)
    return centroids, assignment
