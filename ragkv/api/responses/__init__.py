"""POST /v1/responses."""
