"""Model fingerprints: what makes one model's chunk KV differ from another's.

The chunk store keys every blob by this value, so KV computed by other weights, another
storage dtype, another tokenizer, other numerics (weight formats, compute and cache dtypes), another
architecture or another precompute prefix is never served.
RoPE parameters are left out: keys are stored before rotation.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from ragkv.engine.model_files import cache_root
from ragkv.engine.model_spec import ModelSpec
from ragkv.engine.numerics import Numerics
from ragkv.engine.weights import weight_files

KV_FORMAT_VERSION = 2
"""Bump when the stored blob layout changes; old blobs then read as misses.
2: CRC-32 blob checksum (was blake2b)."""


def _file_digest(path: Path) -> str:
    """blake2b of a weights file, remembered by (path, size, mtime) so starts stay fast."""
    stat = path.stat()
    memo_path = cache_root() / "weight-digests.json"
    memo_key = f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}"
    try:
        memo = json.loads(memo_path.read_text())
    except (OSError, ValueError):
        memo = {}
    if memo_key in memo:
        return memo[memo_key]
    digest = hashlib.blake2b(digest_size=16)
    with open(path, "rb") as handle:
        while block := handle.read(1 << 24):
            digest.update(block)
    memo[memo_key] = digest.hexdigest()
    memo_path.parent.mkdir(parents=True, exist_ok=True)
    staging = memo_path.with_suffix(f".{os.getpid()}.tmp")
    staging.write_text(json.dumps(memo))
    staging.replace(memo_path)
    return memo[memo_key]


def _tokenizer_field(model_dir: Path) -> dict[str, str]:
    """Chunks are found by their text's hash, so another tokenizer over the same weights (a
    GGUF carries its own) must not read them. Absent for a folder without tokenizer.json."""
    path = model_dir / "tokenizer.json"
    return {"tokenizer": _file_digest(path)} if path.is_file() else {}


def model_fingerprint(
    model_dir: Path, spec: ModelSpec, storage_format: str, precompute_prefix: list[int], numerics: Numerics
) -> str:
    """`storage_format` is the KV storage descriptor (ragkv.engine.kv_storage); a float
    format's descriptor is its dtype name, so float16 stores from before the integer
    formats keep their fingerprint."""
    payload = {
        "numerics": numerics.fingerprint_fields(),
        "weights": [_file_digest(path) for path in weight_files(model_dir)],
        **_tokenizer_field(model_dir),
        "spec": spec.fingerprint_fields(),
        "storage_dtype": storage_format,
        "precompute_prefix": precompute_prefix,
        "format": KV_FORMAT_VERSION,
    }
    return hashlib.blake2b(json.dumps(payload, sort_keys=True).encode(), digest_size=12).hexdigest()
