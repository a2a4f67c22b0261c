"""Fusion inputs with their full-prefill reference: `fused_case` on the packaged model (three
short passages and a question), `fusion_case` on any model (random ids)."""

from __future__ import annotations

import torch

from ragkv.engine import Engine
from ragkv.fusion import FusionInput, LoadedChunk

TEXTS = [
    "Gull Point Light was first lit on 3 March 1851 and burned whale oil until 1890. " * 3,
    "Linden Hill Orchard grows nineteen apple varieties on twelve hectares of slope. " * 3,
    "Hallerberg Observatory sits at 1,240 metres on the ridge above the valley towns. " * 3,
]
QUESTION = "When was Gull Point Light first lit?"


def fused_case(engine: Engine) -> tuple[FusionInput, torch.Tensor]:
    chunks = []
    for text in TEXTS:
        ids = engine.tokenize(text)
        keys, values = engine.model.chunk_kv(torch.tensor(ids), engine.chunk_prefix_cache())
        chunks.append(LoadedChunk(ids, keys, values))
    segments = engine.prompt.rag_segments(QUESTION)
    fusion_input = FusionInput(
        segments.prefix_ids, chunks, segments.question_ids, len(engine.chunk_prefix_ids), segments.question_text_span
    )
    prompt = segments.prefix_ids + sum((c.token_ids for c in chunks), []) + segments.question_ids
    _, reference_logits = engine.prefill(prompt)
    return fusion_input, reference_logits


def fusion_case(model, vocab: int, seed: int = 3):
    """(fusion input, prefix cache, full-prefill logits): three 40-token chunks of random ids
    below `vocab`, encoded after a 6-token prefix, then an 8-token question."""

    generator = torch.Generator().manual_seed(seed)
    prefix = torch.randint(3, vocab, (6,), generator=generator)
    prefix_cache = model.new_cache(prefix.numel())
    model.prefill(prefix, prefix_cache)
    chunks = []
    for _ in range(3):
        ids = torch.randint(3, vocab, (40,), generator=generator)
        keys, values = model.chunk_kv(ids, prefix_cache)
        chunks.append(LoadedChunk(ids.tolist(), keys, values))
    question = torch.randint(3, vocab, (8,), generator=generator).tolist()
    fusion_input = FusionInput(prefix.tolist(), chunks, question, chunk_precompute_offset=prefix.numel())
    whole = torch.tensor(prefix.tolist() + sum((chunk.token_ids for chunk in chunks), []) + question)
    return fusion_input, prefix_cache, model.prefill(whole, model.new_cache(whole.numel()))
