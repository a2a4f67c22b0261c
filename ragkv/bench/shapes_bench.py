"""`ragkv bench passages --shapes`: the same dev questions in every prompt shape a real RAG
app sends (ragkv.bench.prompt_shapes), two prompts per question, in process (the engine, a
fresh LMDB store per shape, the product's passage reuse):

    first   the shape's prompt of an example's passages, in their order, and its question
            (every passage new: computed and stored)
    second  the next question of the same user: in the app shapes, 6 of those passages in
            another order beside 4 of the next example's (retrieved sets overlap, they are
            not permutations); in the `splitter` shape, the same documents cut by LangChain's
            recursive character splitter into other chunks (other size, same overlap), shuffled

Per second prompt: the reusable share (tokens covered by a 16-token stretch that both the
first prompt and a passage's own text hold, past the prompts' common prefix, which a
server's prefix cache serves), the share of those served from the store (placed rows;
the probe then recomputes its share of them, counted apart as `cached_share`), the
first-token KL and the teacher-forced agreement against the full prefill of the same
tokens, and the TTFT against that full prefill.
"""

from __future__ import annotations

import random
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import numpy as np

from ragkv.app.chat.conversation import render_conversation
from ragkv.app.passages import FusedPassages, PromptPassages
from ragkv.bench.datasets import Example
from ragkv.bench.passages_bench import _context, _reference, fuse_prompt
from ragkv.bench.prompt_shapes import SHAPES, Passage, split_documents
from ragkv.engine import Engine
from ragkv.fusion import FusionStrategy
from ragkv.fusion.fidelity import TeacherForced, next_token_kl, teacher_forced_logits
from ragkv.store.url import open_store

GRAM = 16
"""Tokens a stretch must share to count as reusable."""
SPLITTER = "splitter"
FIRST_SPLIT, SECOND_SPLIT = (1000, 200), (800, 200)
"""(chunk_size, chunk_overlap) of the splitter shape's two prompts: LangChain's common
setting, then another size with the same overlap, so every chunk edge moves."""
SPLITTER_PASSAGES = 8
"""Passages of an example joined into the splitter shape's document (its chunks' overlap
makes the prompt longer than the passages: 8 keep it inside SmolLM2's context)."""
KEPT, NEW = 6, 4
"""The second prompt of an app shape: passages kept from the first, and new ones."""


@dataclass(frozen=True)
class PromptPair:
    first: list[dict[str, str]]
    second: list[dict[str, str]]
    texts: list[str]
    """Every passage's text (both prompts): what counts as a passage's own tokens."""


def pair_for(shape: str, example: Example, following: Example, rng: random.Random) -> PromptPair:
    """The two prompts of one question in a shape (`following` brings the next question
    and, in the app shapes, the new passages)."""
    if shape == SPLITTER:
        document = "\n\n".join(p.strip() for p in example.passages[:SPLITTER_PASSAGES])
        first = split_documents([document], *FIRST_SPLIT)
        second = split_documents([document], *SECOND_SPLIT)
        rng.shuffle(second)
        render = SHAPES["blank_lines"].messages
        return PromptPair(
            render(_passages(first), example.question),
            render(_passages(second), following.question),
            first + second,
        )
    ours, theirs = [p.strip() for p in example.passages], [p.strip() for p in following.passages]
    kept = rng.sample(ours, KEPT)
    second = kept + rng.sample(theirs, NEW)
    rng.shuffle(second)
    render = SHAPES[shape].messages
    return PromptPair(
        render(_passages(ours), example.question), render(_passages(second), following.question), ours + second
    )


def _passages(texts: list[str]) -> list[Passage]:
    return [Passage(text, _title(text), number) for number, text in enumerate(texts, start=1)]


def _title(text: str) -> str:
    return " ".join(text.split()[:4])


def reusable_mask(first: list[int], second: list[int], passage_ids: list[list[int]]) -> np.ndarray:
    """Per token of `second`: whether a GRAM-token stretch holding it is in `first` and in a
    passage's own tokens, past the two prompts' common prefix."""

    def grams(ids: list[int]) -> set[tuple[int, ...]]:
        return {tuple(ids[i : i + GRAM]) for i in range(len(ids) - GRAM + 1)}

    shared = grams(first) & set().union(*(grams(ids) for ids in passage_ids))
    common = next((i for i, (a, b) in enumerate(zip(first, second)) if a != b), min(len(first), len(second)))
    mask = np.zeros(len(second), dtype=bool)
    for i in range(common, len(second) - GRAM + 1):
        if tuple(second[i : i + GRAM]) in shared:
            mask[i : i + GRAM] = True
    mask[:common] = False
    return mask


def served_mask(fused: FusedPassages, length: int) -> np.ndarray:
    mask = np.zeros(length, dtype=bool)
    for piece in fused.plan.placed:
        mask[piece.start : piece.end] = True
    return mask


@dataclass
class ShapeRow:
    example: int
    prompt_tokens: int
    reusable_share: float
    served_share: float
    """Reusable tokens placed from the store, over the reusable tokens."""
    cached_share: float
    """Prompt rows taken from the store and not recomputed, over the prompt."""
    escalated: bool
    """Whether the probe recomputed further (its first token moved more than `escalate_kl`)."""
    first_token_kl: float
    top1_equal: bool
    teacher_forced_agreement: float
    teacher_forced_kl: float
    ttft_s: float
    full_ttft_s: float
    first_ttft_s: float
    """The first prompt (its passages new, stored as it runs)."""
    first_full_ttft_s: float


def run_shapes(
    engine: Engine,
    examples: list[Example],
    strategy: FusionStrategy,
    shapes: list[str],
    *,
    max_new_tokens: int = 32,
    seed: int = 0,
    progress: Callable[[str], None] = lambda message: None,
    checkpoint: Callable[[dict], None] = lambda partial: None,
) -> dict:
    if len(examples) < 2:
        raise ValueError("the shapes bench needs at least two examples (the next one brings the new passages)")
    unknown = sorted(set(shapes) - set(SHAPES) - {SPLITTER})
    if unknown:
        raise ValueError(f"unknown prompt shapes {unknown}; known: {sorted(SHAPES) + [SPLITTER]}")
    rows: dict[str, list[ShapeRow]] = {}
    for shape in shapes:
        rows[shape] = []
        with tempfile.TemporaryDirectory(prefix="ragkv-shapes-") as folder:
            store = open_store(f"lmdb://{folder}/store")
            try:
                passages = PromptPassages(engine, store)
                _warm_up(engine, passages, strategy)
                rng = random.Random(seed)
                for number, example in enumerate(examples[:-1]):
                    row = _measure(
                        engine,
                        passages,
                        strategy,
                        pair_for(shape, example, examples[number + 1], rng),
                        number,
                        max_new_tokens,
                    )
                    rows[shape].append(row)
                    progress(
                        f"{shape} {number + 1}/{len(examples) - 1}: {row.prompt_tokens} tokens, reusable "
                        f"{row.reusable_share:.2f}, served {row.served_share:.3f}, KL {row.first_token_kl:.4f}, "
                        f"TF {row.teacher_forced_agreement:.3f}, {row.full_ttft_s / row.ttft_s:.1f}x"
                        + (", escalated" if row.escalated else "")
                    )
                    checkpoint(_results(engine, strategy, rows))
            finally:
                store.close()
    return _results(engine, strategy, rows)


def _warm_up(engine: Engine, passages: PromptPassages, strategy: FusionStrategy) -> None:
    """The kernels' first calls, on text of no measured example."""
    words = [" ".join(f"warm{i}-{j}" for j in range(120)) for i in range(2)]
    ids = render_conversation(engine.prompt, SHAPES["blank_lines"].messages(_passages(words), "warm-up?")).token_ids
    fuse_prompt(passages, ids, strategy, 4)
    engine.prefill(ids)


def _measure(engine, passages, strategy, pair: PromptPair, number: int, max_new_tokens: int) -> ShapeRow:
    first = render_conversation(engine.prompt, pair.first).token_ids
    second = render_conversation(engine.prompt, pair.second).token_ids
    started = time.perf_counter()
    engine.prefill(first)
    first_full = time.perf_counter() - started
    _, first_ttft = fuse_prompt(passages, first, strategy, max_new_tokens)
    reference = _reference(engine, second, max_new_tokens)
    fused, ttft = fuse_prompt(passages, second, strategy, max_new_tokens)
    fusion = fused.fusion
    forced = TeacherForced.compare(
        reference.forced, teacher_forced_logits(engine.model, fusion.cache, fusion.logits, reference.answer_ids)
    )
    reusable = reusable_mask(first, second, [engine.prompt.encode(text) for text in pair.texts])
    served = served_mask(fused, len(second)) & reusable
    return ShapeRow(
        example=number,
        prompt_tokens=len(second),
        reusable_share=float(reusable.sum() / len(second)),
        served_share=float(served.sum() / max(1, reusable.sum())),
        cached_share=fused.usage.cached_tokens / len(second),
        escalated=bool(fusion.selection.get("escalated", 0.0)),
        first_token_kl=next_token_kl(reference.logits, fusion.logits),
        top1_equal=int(fusion.logits.argmax()) == int(reference.logits.argmax()),
        teacher_forced_agreement=forced.agreement,
        teacher_forced_kl=forced.kl,
        ttft_s=ttft,
        full_ttft_s=reference.ttft,
        first_ttft_s=first_ttft,
        first_full_ttft_s=first_full,
    )


def _results(engine: Engine, strategy: FusionStrategy, rows: dict[str, list[ShapeRow]]) -> dict:
    summary = {}
    for shape, shape_rows in rows.items():
        if not shape_rows:
            continue
        reusable = sum(r.reusable_share * r.prompt_tokens for r in shape_rows)
        served = sum(r.served_share * r.reusable_share * r.prompt_tokens for r in shape_rows)
        summary[shape] = {
            "questions": len(shape_rows),
            "prompt_tokens": statistics.fmean(r.prompt_tokens for r in shape_rows),
            "reusable_share": reusable / sum(r.prompt_tokens for r in shape_rows),
            "served_share": served / max(reusable, 1e-9),
            "served_share_worst": min(r.served_share for r in shape_rows),
            "cached_share": statistics.fmean(r.cached_share for r in shape_rows),
            "escalated_share": statistics.fmean(r.escalated for r in shape_rows),
            "first_token_kl": statistics.fmean(r.first_token_kl for r in shape_rows),
            "first_token_kl_median": statistics.median(r.first_token_kl for r in shape_rows),
            "top1_agreement": statistics.fmean(r.top1_equal for r in shape_rows),
            "teacher_forced_agreement": statistics.fmean(r.teacher_forced_agreement for r in shape_rows),
            "teacher_forced_agreement_worst": min(r.teacher_forced_agreement for r in shape_rows),
            "teacher_forced_kl": statistics.fmean(r.teacher_forced_kl for r in shape_rows),
            "speedup_median": statistics.median(r.full_ttft_s / r.ttft_s for r in shape_rows),
            "speedup_total": sum(r.full_ttft_s for r in shape_rows) / sum(r.ttft_s for r in shape_rows),
            "first_prompt_slowdown_median": statistics.median(r.first_ttft_s / r.first_full_ttft_s for r in shape_rows),
        }
    return {
        **_context(engine, strategy),
        "gram_tokens": GRAM,
        "shapes": summary,
        "per_question": {shape: [asdict(r) for r in shape_rows] for shape, shape_rows in rows.items()},
    }
