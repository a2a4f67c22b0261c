"""The k-means helper the sparse codebooks are fitted with."""

from __future__ import annotations

import torch

from ragkv.sparse.kmeans import kmeans


def test_kmeans_recovers_separated_clusters():
    g = torch.Generator().manual_seed(0)
    centers = torch.randn(2, 8, 4, generator=g) * 10
    labels = torch.randint(8, (2, 400), generator=g)
    points = (
        torch.gather(centers, 1, labels.unsqueeze(-1).expand(2, 400, 4)) + torch.randn(2, 400, 4, generator=g) * 0.1
    )
    fitted, assignment = kmeans(points, 8, 20, torch.Generator().manual_seed(1))
    # every fitted centroid sits on a true centre, and points of one true cluster share a code
    distance = torch.cdist(fitted, centers).min(-1).values
    assert float(distance.max()) < 0.5
    for b in range(2):
        for label in range(8):
            assert assignment[b][labels[b] == label].unique().numel() == 1
