"""The engine: model, RoPE, KV cache, generation and prompt layout (tensors in, tensors out).

It imports no store, ingestion, API or application module; `ragkv.fusion` and
`ragkv.sparse` belong to it too. tests/test_layout.py checks the direction.

Both names are imported on first use (PEP 562): `EngineConfig` (ragkv.engine.config)
needs no torch, so a command can build its options and refuse bad input without loading
the model's libraries.
"""

from importlib import import_module

__all__ = ["Engine", "EngineConfig"]


def __getattr__(name: str):
    if name == "Engine":
        return import_module("ragkv.engine.core").Engine
    if name == "EngineConfig":
        return import_module("ragkv.engine.config").EngineConfig
    raise AttributeError(f"module 'ragkv.engine' has no attribute {name!r}")
