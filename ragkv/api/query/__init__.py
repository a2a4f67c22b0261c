"""POST /v1/query."""
