"""Retrieval indexes over the document registry: dense (HNSW or a scan), BM25 (SQLite FTS5),
their fusion, and metadata filters. See retrieval.py for how they stay current."""
