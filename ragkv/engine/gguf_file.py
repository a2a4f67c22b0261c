"""What ragkv reads from a GGUF file itself: its architecture (refused early when the forward
loop does not know it) and the 4-bit blocks its decode layers can use as they are.

Everything else (config, tokenizer, chat template, float weights) comes through transformers'
GGUF reader in `ragkv.engine.model_files`. A Q4_0 or Q4_1 block is 32 weights of one row
with a float16 scale (and minimum), which is what ragkv's int4 format stores, so those
tensors are kept bit for bit instead of being rounded a second time from their float values.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ragkv.engine.linear import INT4_GROUP_SIZE, pack_int4_rows, unpack_int4_rows

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "gemma3")
"""GGUF `general.architecture` values the forward loop runs (llama.cpp writes Mistral models
as "llama"; transformers tells them apart by name). A new family adds its name here."""

INT4_EXACT_TYPES = ("Q4_0", "Q4_1")
"""GGUF block types whose weights ragkv's int4 groups hold exactly."""

log = logging.getLogger("ragkv.engine.model")


class UnsupportedModelError(ValueError):
    """A model file ragkv cannot run (its message names what was found and what is supported)."""


@dataclass(frozen=True)
class GGUFInfo:
    architecture: str
    name: str
    tensor_types: dict[str, str]
    """GGUF tensor name -> block type name (F32, F16, Q4_1, Q4_K, ...)."""
    key_length: int | None = None
    """`<arch>.attention.key_length`: the head dimension where it is not hidden / heads
    (Qwen3), which transformers' reader does not take from the file for every architecture."""

    def type_counts(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for kind in self.tensor_types.values():
            counts[kind] = counts.get(kind, 0) + 1
        return dict(sorted(counts.items()))


def _field_text(reader, key: str) -> str:
    field = reader.fields.get(key)
    if field is None:
        return ""
    return bytes(field.parts[field.data[0]]).decode("utf-8", errors="replace")


def read_gguf_info(path: Path) -> GGUFInfo:
    """The file's architecture, name and tensor types; raises a clear error for a file that is
    not GGUF."""
    from gguf import GGUFReader

    try:
        reader = GGUFReader(str(path))
    except (ValueError, OSError) as error:
        raise ValueError(f"{path} is not a readable GGUF file: {error}") from None
    architecture = _field_text(reader, "general.architecture")
    key_length = reader.fields.get(f"{architecture}.attention.key_length")
    return GGUFInfo(
        architecture=architecture,
        name=_field_text(reader, "general.name"),
        tensor_types={tensor.name: tensor.tensor_type.name for tensor in reader.tensors},
        key_length=int(key_length.parts[key_length.data[0]][0]) if key_length is not None else None,
    )


def check_supported(path: Path, info: GGUFInfo) -> None:
    if info.architecture not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedModelError(
            f"{path.name}: GGUF architecture {info.architecture!r} is not supported; "
            f"ragkv runs {', '.join(SUPPORTED_ARCHITECTURES)}"
        )


def _nibble_codes(quants: np.ndarray) -> np.ndarray:
    """[..., 16] bytes -> [..., 32] codes: element j in the low nibble of byte j, element
    j + 16 in its high nibble (ggml's Q4 layout)."""
    return np.concatenate((quants & 0x0F, quants >> 4), axis=-1)


def int4_groups(data: np.ndarray, kind: str, rows: int, columns: int):
    """A Q4_0/Q4_1 tensor's raw blocks -> (codes [rows, groups, 32] uint8, scale and minimum
    [rows, groups] float16) with weight = code * scale + minimum."""
    groups = columns // INT4_GROUP_SIZE
    blocks = np.ascontiguousarray(data).reshape(rows, groups, -1)
    scale = blocks[..., 0:2].copy().view(np.float16)[..., 0]
    if kind == "Q4_0":  # w = (q - 8) d
        low = (scale.astype(np.float32) * -8).astype(np.float16)
        codes = _nibble_codes(blocks[..., 2:18])
    elif kind == "Q4_1":  # w = q d + m
        low = blocks[..., 2:4].copy().view(np.float16)[..., 0]
        codes = _nibble_codes(blocks[..., 4:20])
    else:
        raise ValueError(f"{kind} blocks are not int4 groups")
    return codes, scale, low


def exact_int4_rows(path: Path, config, float_weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Packed int4 rows (ragkv.engine.linear's layout) of every Q4_0/Q4_1 matrix in the GGUF
    at `path`, keyed by its Hugging Face weight name. `float_weights` are the weights
    transformers dequantised from the same file; a tensor is kept only when its blocks
    reproduce them bit for bit, so a name or row-order mapping this code gets wrong falls back
    to requantising instead of serving wrong weights."""
    from gguf import GGUFReader
    from transformers import AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import (
        TENSOR_PROCESSORS,
        TensorProcessor,
        get_gguf_hf_weights_map,
    )

    reader = GGUFReader(str(path))
    architecture = _field_text(reader, "general.architecture")
    processor = TENSOR_PROCESSORS.get(architecture, TensorProcessor)(config=config.to_dict())
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    names = get_gguf_hf_weights_map(skeleton, processor, model_type=architecture)
    held: dict[str, torch.Tensor] = {}
    for tensor in reader.tensors:
        kind = tensor.tensor_type.name
        if kind not in INT4_EXACT_TYPES or len(tensor.shape) != 2:
            continue
        columns, rows = (int(n) for n in tensor.shape)  # GGUF lists the fastest dimension first
        codes, scale, low = int4_groups(tensor.data, kind, rows, columns)
        # Row permutations (llama.cpp reorders Llama's q/k rows for its RoPE) act on whole
        # rows, so the processor that undoes them on the float weights undoes them here too.
        codes = processor.process(weights=codes, name=tensor.name).weights
        scale = processor.process(weights=scale, name=tensor.name).weights
        low = processor.process(weights=low, name=tensor.name).weights
        hf_name = names.get(tensor.name)
        if hf_name is None or hf_name not in float_weights:
            continue
        packed = pack_int4_rows(*(torch.from_numpy(np.ascontiguousarray(part)) for part in (codes, scale, low)))
        if torch.equal(dequantize_int4_rows(packed, columns), float_weights[hf_name].float()):
            held[hf_name] = packed
        else:
            log.warning(
                "%s: the %s blocks of %s do not reproduce its weights; they will be requantised",
                path.name,
                kind,
                tensor.name,
            )
    return held


def dequantize_int4_rows(rows: torch.Tensor, in_features: int) -> torch.Tensor:
    """The float32 weight [out, in] packed int4 rows hold (as Int4Kernel.dequantized)."""
    codes, scale, low = unpack_int4_rows(rows, in_features)
    return (codes.float() * scale.float()[..., None] + low.float()[..., None]).flatten(1)
