"""GET /health and GET /metrics."""
