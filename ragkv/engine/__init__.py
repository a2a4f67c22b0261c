"""The engine: model, RoPE, KV cache, generation and prompt layout (tensors in, tensors out).

It imports no store, ingestion, API or application module; `ragkv.fusion` and
`ragkv.sparse` belong to it too. tests/test_layout.py checks the direction.
"""

from ragkv.engine.core import Engine, EngineConfig

__all__ = ["Engine", "EngineConfig"]
