"""Teacher-forced fidelity: a fused cache read along the full prefill's own answer (the
measure `ragkv bench fusion` reports and `ragkv calibrate fusion` chooses a ratio by).

Free-running answers of a small model fork at near-ties even when the caches differ by
almost nothing, so comparing answers measures that chaos more than the cache. Here the
full prefill's greedy answer is fed through both caches and the next-token distributions
are compared at every answer position: position 0 is the first token (the fusion's
logits), position i > 0 the distribution after the first i answer tokens. Each position
is computed by the same decode step that serves requests, so the full prefill's argmax at
every position is its greedy token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ragkv.engine.kv_cache import KVCache
from ragkv.engine.model import CausalLM


def next_token_kl(reference_logits: torch.Tensor, logits: torch.Tensor) -> float:
    """KL(reference || other) of two next-token distributions, in nats (float64)."""
    reference = reference_logits.double().log_softmax(-1)
    other = logits.double().log_softmax(-1)
    return float((reference.exp() * (reference - other)).sum())


@torch.inference_mode()
def teacher_forced_logits(
    model: CausalLM, cache: KVCache, first_logits: torch.Tensor, answer_ids: list[int]
) -> torch.Tensor:
    """[len(answer_ids), vocab] float32: the next-token logits before each answer token,
    with the earlier answer tokens fed in. The cache is left as it was given (rows written
    past its length are forgotten)."""
    if not answer_ids:
        raise ValueError("teacher forcing needs at least one answer token")
    length = cache.length
    rows = [first_logits.float()]
    try:
        for token in answer_ids[:-1]:
            rows.append(model.decode_step(token, cache).float())
    finally:
        cache.truncate(length)
    return torch.stack(rows)


@dataclass(frozen=True)
class TeacherForced:
    agreement: float
    """Share of answer positions whose argmax equals the reference's."""
    kl: float
    """Mean KL(reference || other) over answer positions, in nats."""
    kl_max: float
    positions: int

    @classmethod
    def compare(cls, reference: torch.Tensor, other: torch.Tensor) -> TeacherForced:
        """Both [positions, vocab] from `teacher_forced_logits` over the same answer."""
        if reference.shape != other.shape:
            raise ValueError(f"teacher-forced logits differ in shape: {tuple(reference.shape)} vs {tuple(other.shape)}")
        kls = [next_token_kl(reference[i], other[i]) for i in range(reference.shape[0])]
        agree = (reference.argmax(-1) == other.argmax(-1)).double().mean()
        return cls(float(agree), float(sum(kls) / len(kls)), max(kls), len(kls))
