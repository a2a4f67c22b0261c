"""The embedder prints nothing: every retrieval embeds a question, and sentence-transformers'
"Batches" progress bar (shown whenever its logger is at INFO, as a verbose server's is)
would land in the server log."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from ragkv.ingest.embedder import Embedder


@pytest.fixture(scope="module")
def embedder() -> Embedder:
    return Embedder()


def test_embedding_prints_no_progress_bar(embedder, capfd):
    logger = logging.getLogger("sentence_transformers")
    level = logger.level
    logger.setLevel(logging.INFO)
    try:
        capfd.readouterr()
        queries = embedder.embed_queries(["Who wrote Hannibal and Scipio?"])
        passages = embedder.embed_passages(["Hannibal and Scipio is a play.", "word " * 400])
        captured = capfd.readouterr()
    finally:
        logger.setLevel(level)
    assert "Batches" not in captured.err + captured.out
    assert "%|" not in captured.err + captured.out
    # the same vectors as the model's own encode (the reference)
    question = ["Who wrote Hannibal and Scipio?"]
    expected = embedder.model.encode(question, normalize_embeddings=True, convert_to_numpy=True)
    np.testing.assert_allclose(queries, expected, atol=1e-6)
    assert passages.shape == (2, embedder.dimension)
    np.testing.assert_allclose(np.linalg.norm(passages, axis=1), 1.0, atol=1e-5)
