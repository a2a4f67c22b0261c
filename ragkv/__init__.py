"""ragkv: RAG serving middleware over precomputed, position-independent chunk KV caches."""

__version__ = "0.1.0"
