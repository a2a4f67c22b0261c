"""Response models (ragkv.api.protocol) built from application types, one module per
endpoint (vLLM's `serving`): the only place that knows both."""
