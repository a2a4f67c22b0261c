"""ragkv's HTTP API: FastAPI app (api.app.create_app), run by `ragkv serve`.

Routes in api/routes, request schemas in api/schemas.py, the model worker that owns the
engine in api/worker.py, what it runs in api/service.py, chat sessions in api/sessions.py,
ingestion jobs in api/jobs.py, API keys in api/auth.py, metrics in api/metrics.py.
"""
