"""ragkv's HTTP API: FastAPI app (api.app.create_app), run by `ragkv serve`.

Routes in api/routes, request schemas in api/schemas.py, the model worker that owns the
engine in api/worker.py (requests reach the scheduler through api/request_stream.py, other
work is an api/task.py Task), what it runs in api/service.py, the session id check in
api/sessions.py (the session store is ragkv.app.session_store), ingestion task records
(GET /v1/jobs) in app/ingest_records.py, API keys in api/auth.py, metrics in api/metrics.py.
"""
