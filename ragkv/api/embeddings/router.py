"""OpenAI embeddings: POST /v1/embeddings, from the packaged all-MiniLM-L6-v2."""

from __future__ import annotations

from fastapi import APIRouter, Request

from ragkv.api.auth import tenant_of
from ragkv.api.common.protocol import EMBEDDING_MODEL_ID
from ragkv.api.embeddings.protocol import EmbeddingList, EmbeddingRequest
from ragkv.api.embeddings.serving import embedding_list
from ragkv.api.errors import ApiError
from ragkv.api.json_response import SafeJSONResponse
from ragkv.api.openapi import errors
from ragkv.api.state import app_state
from ragkv.api.streaming import run_task

router = APIRouter(tags=["openai"], default_response_class=SafeJSONResponse)


@router.post("/v1/embeddings", response_model=EmbeddingList, responses=errors(400, 401, 404, 413, 503))
async def embeddings(request: Request, body: EmbeddingRequest):
    """OpenAI embeddings from the packaged all-MiniLM-L6-v2: unit vectors."""
    state = app_state(request)
    tenant_of(request)
    if body.model != EMBEDDING_MODEL_ID:
        raise ApiError(
            404,
            "model_not_found",
            f"the embedding model {body.model!r} does not exist; this server serves {EMBEDDING_MODEL_ID!r}",
            param="model",
        )
    dimension = state.client.embedding_dimension
    if body.dimensions is not None and body.dimensions != dimension:
        raise ApiError(
            400,
            "unsupported_parameter",
            f"dimensions must be {dimension} (or absent): this model's vectors are not truncated",
            param="dimensions",
        )
    texts = [body.input] if isinstance(body.input, str) else list(body.input)
    embedded = await run_task(request, state.client.embed(texts))
    return embedding_list(EMBEDDING_MODEL_ID, embedded.vectors, embedded.tokens, body.encoding_format == "base64")
