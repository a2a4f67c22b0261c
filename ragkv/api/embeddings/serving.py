"""POST /v1/embeddings' answer from the embedder's vectors."""

from __future__ import annotations

import base64
from collections.abc import Sequence

from ragkv.api.embeddings.protocol import Embedding, EmbeddingList, EmbeddingUsage


def embedding_list(model: str, vectors: Sequence, tokens: int, base64_encoded: bool) -> EmbeddingList:
    """`vectors`: float32 arrays; `base64_encoded`: each as base64 of its little-endian bytes."""

    def encoded(vector) -> list[float] | str:
        if base64_encoded:
            return base64.b64encode(vector.astype("<f4").tobytes()).decode("ascii")
        return vector.tolist()

    return EmbeddingList(
        model=model,
        data=[Embedding(index=i, embedding=encoded(v)) for i, v in enumerate(vectors)],
        usage=EmbeddingUsage(prompt_tokens=tokens, total_tokens=tokens),
    )
