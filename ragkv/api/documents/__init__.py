"""/v1/documents and /v1/jobs."""
