"""The API's response bodies, one module per endpoint (vLLM's `protocol`).

Each JSON route names its model as `response_model`: the OpenAPI document and what is
sent come from the same class, and a field the model does not declare is not sent. The
models are built from application types by ragkv.api.serving, never by the application.
"""
