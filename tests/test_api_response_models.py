"""Every JSON route declares its response model, and what it sends is that model exactly.

The OpenAPI document's success body of each JSON route is a $ref to the route's
`response_model`; against a live `ragkv serve`, each route's real answer validates as that
model and dumps back to the same JSON (a field the model does not declare is not sent,
and none it declares is missing).
"""

from __future__ import annotations

import typing
from pathlib import Path

import httpx
import pytest
from fastapi.routing import APIRoute
from pydantic import BaseModel

from ragkv.api.app import create_app
from ragkv.api.chat.protocol import ChatCompletion, Model, ModelList, SessionList
from ragkv.api.common.protocol import Deleted
from ragkv.api.completions.protocol import Completion
from ragkv.api.documents.protocol import DocumentCreated, DocumentDetail, DocumentList, JobList
from ragkv.api.embeddings.protocol import EmbeddingList
from ragkv.api.query.protocol import QueryResponse
from ragkv.api.responses.protocol import ResponseObject
from ragkv.api.routers import ROUTERS
from ragkv.api.system.protocol import Health

CORPUS = Path(__file__).resolve().parents[1] / "examples" / "corpus"
NOT_JSON = {"/metrics"}


def _json_routes() -> list[APIRoute]:
    found = [route for router in ROUTERS for route in router.routes]
    return [r for r in found if isinstance(r, APIRoute) and r.include_in_schema and r.path not in NOT_JSON]


def test_every_json_route_declares_its_response_model():
    app = create_app()
    schema = app.openapi()
    routes = _json_routes()
    assert len(routes) >= 15
    for route in routes:
        assert route.response_model is not None, f"{route.path} has no response_model"
        model = route.response_model
        listed = typing.get_origin(model) is list  # the render call of completions: one entry per prompt
        model = typing.get_args(model)[0] if listed else model
        assert issubclass(model, BaseModel)
        for method in route.methods:
            responses = schema["paths"][route.path][method.lower()]["responses"]
            success = responses[str(route.status_code or 200)]
            body = success["content"]["application/json"]["schema"]
            ref = {"$ref": f"#/components/schemas/{model.__name__}"}
            assert body == ({"type": "array", "items": ref} if listed else ref) or (
                listed and body.get("items") == ref
            ), (
                route.path,
                body,
            )


def test_a_response_model_filters_what_it_does_not_declare():
    """The property the routes rely on: a stray field never reaches the client."""
    deleted = Deleted.model_validate({"id": "d", "object": "document", "deleted": True, "secret": "x"})
    assert deleted.model_dump(mode="json") == {"id": "d", "object": "document", "deleted": True}


def _exactly(model: type[BaseModel], response: httpx.Response) -> BaseModel:
    assert response.status_code < 300, response.text
    body = response.json()
    parsed = model.model_validate(body)
    assert parsed.model_dump(mode="json") == body, f"{response.request.url} sent fields its model lacks"
    return parsed


@pytest.mark.model
def test_real_answers_are_their_response_models(shared_server):
    """On the shared server (tests/conftest.py), as this module's tenant."""
    path = sorted(CORPUS.iterdir())[0]
    headers = {"Authorization": f"Bearer {shared_server.key['response-models']}"}
    with httpx.Client(base_url=shared_server.url, headers=headers, timeout=300) as client:
        _exactly(Health, client.get("/health"))
        created = _exactly(DocumentCreated, client.post("/v1/documents", json={"text": path.read_text()}))
        doc_id = created.document.id
        _exactly(DocumentList, client.get("/v1/documents"))
        _exactly(DocumentDetail, client.get(f"/v1/documents/{doc_id}", params={"include_text": True}))
        _exactly(JobList, client.get("/v1/jobs"))
        query = _exactly(QueryResponse, client.post("/v1/query", json={"question": "Who?", "max_tokens": 4}))
        assert query.citations and query.timings["total"] > 0
        _exactly(ModelList, client.get("/v1/models"))
        _exactly(Model, client.get("/v1/models/ragkv"))
        chat = _exactly(
            ChatCompletion,
            client.post(
                "/v1/chat/completions",
                json={"model": "ragkv", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4},
            ),
        )
        _exactly(SessionList, client.get("/v1/sessions"))
        _exactly(Completion, client.post("/v1/completions", json={"model": "ragkv", "prompt": "A", "max_tokens": 2}))
        _exactly(EmbeddingList, client.post("/v1/embeddings", json={"model": "all-MiniLM-L6-v2", "input": "a"}))
        _exactly(
            ResponseObject, client.post("/v1/responses", json={"model": "ragkv", "input": "Hi", "max_output_tokens": 2})
        )
        assert chat.rag.session_id == chat.session_id
        _exactly(Deleted, client.delete(f"/v1/documents/{doc_id}"))
