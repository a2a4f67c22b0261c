"""ragkv's HTTP API: FastAPI app (api.app.create_app), run by `ragkv serve`.

Per endpoint, as vLLM's entrypoints: the route in api/routes converts the request (request
schemas in api/schemas.py), api/serving builds the response from application types, and
api/protocol holds the response models the routes declare as `response_model`. The API
imports only ragkv.app (and shared error types): the engine, fusion, ingestion and store
are the application's to compose. The model worker that owns the engine is api/worker.py
(requests reach the scheduler through api/request_stream.py, other work is an api/task.py
Task), what it runs is api/model_work.py, the session id check api/sessions.py, API keys
api/auth.py, metrics api/metrics.py.
"""
