"""The cost of quantised decode weights, in the fusion bench's own figures.

Users already accept int4 or int8 decode weights; this puts a number on that cost next to
the cost of fusion: each format's full prefill of the bench's prompts against a float32
engine (float32 weights for prefill and decode, float32 KV cache), with first-token KL,
teacher-forced agreement and KL along the float32 greedy answer, and the free-running
answer's token-F1 against float32's.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ragkv.app.generate import decode, forced_answer_ids
from ragkv.bench.metrics import token_f1
from ragkv.engine import Engine, EngineConfig
from ragkv.engine.generation import GenerationConfig
from ragkv.fusion.fidelity import TeacherForced, next_token_kl, teacher_forced_logits

REFERENCE_NUMERICS = {
    "dtype": "float32",
    "weights": "float32",
    "prefill_weights": "float32",
    "kv_cache_dtype": "float32",
}


@dataclass(frozen=True)
class WeightVariant:
    label: str
    config: EngineConfig


def weight_variants(base: EngineConfig, formats: list[str]) -> list[WeightVariant]:
    """One engine per decode-weight format, everything else float32; 'served' is `base` as
    the server runs it (every "auto" resolved for this machine)."""
    variants = []
    for name in formats:
        if name == "served":
            variants.append(WeightVariant("served", base))
        else:
            variants.append(
                WeightVariant(f"weights={name}", dataclasses.replace(base, **{**REFERENCE_NUMERICS, "weights": name}))
            )
    return variants


def _answer(engine: Engine, prompt: list[int], max_new_tokens: int):
    cache, logits = engine.prefill(prompt, max_new_tokens)
    completion = decode(engine, cache, logits, GenerationConfig(max_new_tokens=max_new_tokens))
    cache.truncate(len(prompt))
    return cache, logits, completion.text.strip(), forced_answer_ids(completion)


def run_weight_fidelity(
    base: EngineConfig,
    prompts: list[list[int]],
    formats: list[str],
    *,
    max_new_tokens: int = 32,
    progress: Callable[[str], None] = lambda message: None,
) -> dict:
    """Per format: the per-prompt rows and their means."""
    reference_engine = Engine(dataclasses.replace(base, **REFERENCE_NUMERICS))
    references = []
    for number, prompt in enumerate(prompts, start=1):
        progress(f"float32 reference {number}/{len(prompts)}")
        cache, logits, answer, answer_ids = _answer(reference_engine, prompt, max_new_tokens)
        references.append(
            (logits, answer, answer_ids, teacher_forced_logits(reference_engine.model, cache, logits, answer_ids))
        )
    del reference_engine
    results = {}
    for variant in weight_variants(base, formats):
        engine = Engine(variant.config)
        rows = []
        for number, (prompt, (logits, answer, answer_ids, forced_reference)) in enumerate(zip(prompts, references), 1):
            progress(f"{variant.label} {number}/{len(prompts)}")
            cache, own_logits, own_answer, _ = _answer(engine, prompt, max_new_tokens)
            forced = TeacherForced.compare(
                forced_reference, teacher_forced_logits(engine.model, cache, own_logits, answer_ids)
            )
            rows.append(
                {
                    "first_token_kl": next_token_kl(logits, own_logits),
                    "top1_equal": int(own_logits.argmax()) == int(logits.argmax()),
                    "teacher_forced_agreement": forced.agreement,
                    "teacher_forced_kl": forced.kl,
                    "answer_agreement": token_f1(own_answer, [answer]),
                }
            )
        results[variant.label] = {
            "numerics": str(engine.model.numerics),
            **{key: float(torch.tensor([float(row[key]) for row in rows]).mean()) for key in rows[0]},
            "per_example": rows,
        }
        del engine
    return results
