"""ragkv's HTTP API: FastAPI app (api.app.create_app), run by `ragkv serve`.

One folder per endpoint, as vLLM's entrypoints (api/routers.py lists them): `router.py`
converts the request, `protocol.py` holds the request, response and stream-chunk models
(the routes' `response_model`: the schema is the validation), `serving.py` builds the answer
from application types. What endpoints share is in api/common (protocol bases and parts,
serving helpers, the conversion into the application's typed configs); no endpoint imports
another's (tests/test_layout.py). The API
imports only ragkv.app (and shared error types): the engine, fusion, ingestion and store
are the application's to compose. Routes call the engine client's methods
(ragkv.app.server.EngineClient, which owns the model worker, its tasks and request streams)
and convert its typed results; the session id check is api/sessions.py,
API keys api/auth.py, metrics api/metrics.py.
"""
