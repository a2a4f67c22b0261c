"""The two calls the query path (ragkv.app.rag) makes into sparse decode."""

from __future__ import annotations

import torch

from ragkv.engine.kv_storage import dense
from ragkv.sparse.config import SparseConfig
from ragkv.sparse.prompt import PromptState


def sparse_chunk_codes(
    engine, codebook, config: SparseConfig | None, chunks, stored: list[dict] | None
) -> list[torch.Tensor] | None:
    """Per retrieved chunk, its A2ATS codes under the model's `codebook`: the stored codes
    when their codebook id matches `codebook`, else computed now from the
    chunk's stored pre-RoPE keys (never stale). None unless the selector needs the codebook."""
    if config is None or not config.options.needs_codebook:
        return None
    if codebook is None:
        raise ValueError(
            f"the {config.name} selector needs an A2ATS codebook for this model: run `ragkv calibrate` first"
        )
    stored = stored or [None] * len(chunks)
    codes = []
    for chunk, tensors in zip(chunks, stored):
        found = codebook.codes_of(tensors)
        if found is None:
            found = codebook.encode(dense(chunk.keys, torch.float32).to(engine.model.device))
        codes.append(found)
    return codes


def sparse_attention(engine, codebook, config: SparseConfig | None, fusion, chunk_codes=None):
    """The DecodeAttention for a fused prompt (None = dense). SnapKV, when configured,
    compacts fusion.cache here: the first token's logits are already computed."""
    if config is None:
        return None
    prompt = PromptState.from_fusion(engine.model, fusion, chunk_codes or ())
    return config.build(prompt, codebook)
