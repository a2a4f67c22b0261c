"""POST /v1/chat/completions, GET /v1/models and the session routes."""
