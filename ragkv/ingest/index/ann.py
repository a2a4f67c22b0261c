"""The approximate nearest-neighbour graph under a large tenant's dense index: usearch's
HNSW (chosen by measurement among faiss-cpu, usearch and hnswlib; see ARCHITECTURE.md).

usearch adds and removes single vectors in place (faiss's HNSW cannot remove), keeps its
vectors as float16 here (the dense index rescores candidates from its own float32 rows, so
scores stay exact and the graph costs half the memory), and serialises to a buffer that
the index's one snapshot file holds.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from usearch.index import Index


@dataclass(frozen=True)
class GraphConfig:
    connectivity: int = 32
    """Neighbours per node (HNSW's M). With 16, a tenant of tight 50-chunk documents became
    nearly a set of cliques that searches could not route between (recall, BENCHMARKS.md)."""
    expansion_add: int = 128
    """Candidate list while inserting (efConstruction)."""
    expansion_search: int = 192
    """Candidate list while searching (ef): recall against time."""
    dtype: str = "f16"
    """How the graph keeps its copy of the vectors (f32, f16, i8); candidates are rescored
    from the dense index's float32 rows either way."""

    def __post_init__(self) -> None:
        if not 4 <= self.connectivity <= 128 or self.expansion_add < 8 or self.expansion_search < 8:
            raise ValueError("connectivity must be in [4, 128] and the expansions at least 8")
        if self.dtype not in ("f32", "f16", "i8"):
            raise ValueError(f"dtype must be f32, f16 or i8, got {self.dtype!r}")


class Graph:
    """Row numbers of the dense index as keys; inner product on unit vectors."""

    def __init__(self, dim: int, config: GraphConfig = GraphConfig()):
        self.config = config
        self._index = Index(
            ndim=dim,
            metric="ip",
            dtype=config.dtype,
            connectivity=config.connectivity,
            expansion_add=config.expansion_add,
            expansion_search=config.expansion_search,
        )

    def __len__(self) -> int:
        return len(self._index)

    def add(self, rows: np.ndarray, vectors: np.ndarray, threads: int = 1) -> None:
        self._index.add(rows.astype(np.uint64), vectors, threads=threads)

    def remove(self, rows: np.ndarray) -> None:
        self._index.remove(rows.astype(np.uint64))

    def search(self, vector: np.ndarray, count: int) -> np.ndarray:
        """Row numbers of up to `count` nearest rows, nearest first."""
        return self._index.search(vector, count, threads=1).keys.astype(np.int64)

    def set_expansion_search(self, expansion: int) -> None:
        self._index.expansion_search = expansion

    def to_bytes(self) -> np.ndarray:
        return np.frombuffer(bytes(self._index.save()), dtype=np.uint8)

    @classmethod
    def from_bytes(cls, dim: int, blob: np.ndarray, config: GraphConfig = GraphConfig()) -> Graph:
        graph = cls(dim, config)
        graph._index.load(blob.tobytes())
        graph._index.expansion_search = config.expansion_search
        return graph
