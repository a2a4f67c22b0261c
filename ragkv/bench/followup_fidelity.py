"""How close a chat follow-up that fuses one new chunk comes to the exact answer, and at
what cost (`ragkv bench conversation --fidelity`).

Per example: a long conversation (the example's passages, then later examples' until
`context_tokens`) is prefilled exactly; one new ~120-token chunk (the example's first
passage, cut) arrives with the example's question. The reference is exact given that
conversation: the chunk and the question prefilled onto a copy of its cache. Each strategy
fuses the chunk, as stored, into another copy in place (what a follow-up does) and is
compared with the reference: first-token KL and the teacher-forced figures along the
reference's greedy answer (ragkv.fusion.fidelity). The fuse time is the stage alone.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

from ragkv.bench.datasets import Example
from ragkv.engine.core import Engine
from ragkv.fusion import FusionInput, LoadedChunk, build_strategy
from ragkv.fusion.fidelity import TeacherForced, next_token_kl, teacher_forced_logits

NEW_CHUNK_TOKENS = 120


def followup_prompt(
    engine: Engine, examples: list[Example], index: int, context_tokens: int
) -> tuple[list[int], list[int], list[int]]:
    """(conversation ids, new chunk ids, question ids) for example `index`."""
    example = examples[index]
    conversation: list[int] = []
    passages = [*example.passages[1:], *(p for later in examples[index + 1 :] for p in later.passages)]
    for passage in passages:
        if len(conversation) >= context_tokens:
            break
        conversation += engine.tokenize(passage)
    if len(conversation) < context_tokens:
        raise ValueError(
            f"the dataset holds {len(conversation)} tokens after example {index}, fewer than {context_tokens}"
        )
    chunk = engine.tokenize(example.passages[0])[:NEW_CHUNK_TOKENS]
    question = engine.tokenize(f"\n\nQuestion: {example.question}\nAnswer:")
    return conversation[:context_tokens], chunk, question


def greedy_ids(model, cache, logits: torch.Tensor, count: int) -> list[int]:
    """`count` greedy tokens after `logits`; the cache is left at its length."""
    length, ids = cache.length, []
    try:
        while True:
            ids.append(int(logits.argmax()))
            if len(ids) == count:
                return ids
            logits = model.decode_step(ids[-1], cache)
    finally:
        cache.truncate(length)


@torch.inference_mode()
def run_followup_fidelity(
    engine: Engine,
    examples: list[Example],
    strategies: list[str],
    *,
    context_tokens: int = 6000,
    count: int = 10,
    max_new_tokens: int = 16,
    progress: Callable[[str], None] = lambda message: None,
) -> dict:
    model = engine.model
    built = {spec: build_strategy(spec) for spec in strategies}
    rows: dict[str, list[dict]] = {spec: [] for spec in strategies}
    for index in range(count):
        conversation, chunk_ids, question = followup_prompt(engine, examples, index, context_tokens)
        extra = len(chunk_ids) + len(question) + max_new_tokens + 1
        conversation_cache, _ = engine.prefill(conversation, extra)
        reference_cache = conversation_cache.clone(extra)
        reference_logits = model.prefill(torch.tensor(chunk_ids + question), reference_cache)
        answer = greedy_ids(model, reference_cache, reference_logits, max_new_tokens)
        reference = teacher_forced_logits(model, reference_cache, reference_logits, answer)
        chunk = LoadedChunk(chunk_ids, *engine.kv_format.unpack(engine.encode_chunk(chunk_ids)))
        fusion_input = FusionInput(conversation, [chunk], question, len(engine.chunk_prefix_ids))
        for spec, strategy in built.items():
            cache = conversation_cache.clone(extra)
            started = time.perf_counter()
            result = strategy.fuse(model, fusion_input, cache, max_new_tokens + 1, in_place=True)
            fuse_s = time.perf_counter() - started
            forced = TeacherForced.compare(reference, teacher_forced_logits(model, result.cache, result.logits, answer))
            row = {
                "first_token_kl": next_token_kl(reference_logits, result.logits),
                "teacher_forced_agreement": forced.agreement,
                "teacher_forced_kl": forced.kl,
                "fuse_s": fuse_s,
                "recomputed_tokens": result.recomputed_tokens,
            }
            rows[spec].append(row)
            progress(
                f"example {index + 1}/{count} {spec}: KL {row['first_token_kl']:.4f}, forced "
                f"{forced.agreement:.2f}/{forced.kl:.4f}, fuse {fuse_s:.3f} s"
            )
    summary = {}
    for spec, per_example in rows.items():
        summary[spec] = {
            key: statistics.fmean(row[key] for row in per_example)
            for key in ("first_token_kl", "teacher_forced_agreement", "teacher_forced_kl")
        }
        summary[spec]["first_token_kl_median"] = statistics.median(row["first_token_kl"] for row in per_example)
        summary[spec]["fuse_median_s"] = statistics.median(row["fuse_s"] for row in per_example)
        summary[spec]["examples"] = per_example
    return {"context_tokens": context_tokens, "new_chunk_tokens": NEW_CHUNK_TOKENS, "strategies": summary}
