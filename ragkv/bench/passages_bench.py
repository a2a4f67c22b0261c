"""`ragkv bench passages`: passages pasted into the prompt, as a RAG application sends them.

Two runs, both in process (the engine, a fresh LMDB store of their own, the span finder):

fidelity   per dev example, its passages pasted in their order (the cold prompt: every
           passage new, computed and stored), then the same passages shuffled under another
           question's header (the warm prompt). Both are also prefilled in full: the cold
           prompt's TTFT against its full prefill (what passages seen for the first time
           cost), and the warm prompt's first-token KL and teacher-forced agreement against
           the full prefill of the same tokens (fusion_bench's figures), with its speed-up.
sustained  a pool of passages (every passage of the dataset), queries that each paste
           `--min-passages`..`--max-passages` of them in random order, the store capped at a
           share of the pool's KV bytes (LRU): per window of queries the span hit rate, the
           share of prompt rows reused and the TTFT, so a decay (prompt entries flooding the
           store and evicting passages) would show.
"""

from __future__ import annotations

import platform
import random
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from ragkv.app.chat.conversation import render_conversation
from ragkv.app.generate import decode, forced_answer_ids
from ragkv.app.passages import FusedPassages, PromptPassages
from ragkv.bench.datasets import Example
from ragkv.bench.fusion_bench import summarize
from ragkv.bench.metrics import normalize_answer, token_f1
from ragkv.engine import Engine
from ragkv.engine.generation import GenerationConfig
from ragkv.fusion import FusionStrategy
from ragkv.fusion.fidelity import TeacherForced, next_token_kl, teacher_forced_logits
from ragkv.store.recency import DEFAULT_PROTECTED_SHARE
from ragkv.store.url import open_store

SYSTEM = "Answer the question using the documents given."
TENANT = "bench"


def stuffed_ids(engine: Engine, passages: list[str], question: str) -> list[int]:
    """The chat prompt a RAG application builds: passages joined by blank lines."""
    documents = "\n\n".join(p.strip() for p in passages)
    messages = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": f"Documents:\n{documents}\n\nQuestion: {question}"},
    ]
    return render_conversation(engine.prompt, messages).token_ids


def fuse_prompt(
    passages: PromptPassages, ids: list[int], strategy: FusionStrategy, max_new_tokens: int
) -> tuple[FusedPassages | None, float]:
    """What a chat turn with no cached prefix does: plan, prefill up to the first passage,
    fuse. (None, 0) when the prompt holds no passage."""
    started = time.perf_counter()
    fused = passages.prepare_prompt(TENANT, ids, strategy, max_new_tokens)
    if fused is None:
        return None, 0.0
    return fused, time.perf_counter() - started


@dataclass
class _Reference:
    logits: torch.Tensor
    forced: torch.Tensor
    answer: str
    answer_ids: list[int]
    ttft: float


def _reference(engine: Engine, ids: list[int], max_new_tokens: int) -> _Reference:
    started = time.perf_counter()
    cache, logits = engine.prefill(ids, max_new_tokens)
    ttft = time.perf_counter() - started
    completion = decode(engine, cache, logits, GenerationConfig(max_new_tokens=max_new_tokens))
    cache.truncate(len(ids))
    answer_ids = forced_answer_ids(completion)
    forced = teacher_forced_logits(engine.model, cache, logits, answer_ids)
    return _Reference(logits, forced, completion.text.strip(), answer_ids, ttft)


def run_passage_fidelity(
    engine: Engine,
    examples: list[Example],
    strategy: FusionStrategy,
    *,
    max_new_tokens: int = 32,
    seed: int = 0,
    progress: Callable[[str], None] = lambda message: None,
    checkpoint: Callable[[dict], None] = lambda partial: None,
) -> dict:
    folder = tempfile.TemporaryDirectory(prefix="ragkv-passages-")
    store = open_store(f"lmdb://{folder.name}/store")
    try:
        passages = PromptPassages(engine, store)
        # warm-up: the kernels' first calls, on passages of no measured example
        warm_up = stuffed_ids(engine, [" ".join(p.split()[::-1]) for p in examples[0].passages[:2]], "warm-up")
        fuse_prompt(passages, warm_up, strategy, 4)
        engine.prefill(warm_up)
        full_rows, warm_rows, cold_rows = [], [], []
        rng = random.Random(seed)
        for number, example in enumerate(examples, start=1):
            cold_ids = stuffed_ids(engine, example.passages, example.question)
            started = time.perf_counter()
            _, cold_logits = engine.prefill(cold_ids)
            cold_full = time.perf_counter() - started
            cold, cold_ttft = fuse_prompt(passages, cold_ids, strategy, max_new_tokens)
            cold_rows.append(
                {
                    "full_ttft_s": cold_full,
                    "ttft_s": cold_ttft,
                    "spans": len(cold.plan.spans),
                    "hits": cold.plan.hits,
                    "first_token_kl": next_token_kl(cold_logits, cold.fusion.logits),
                }
            )
            order = list(range(len(example.passages)))
            rng.shuffle(order)
            warm_ids = stuffed_ids(engine, [example.passages[i] for i in order], example.question)
            reference = _reference(engine, warm_ids, max_new_tokens)
            warm, warm_ttft = fuse_prompt(passages, warm_ids, strategy, max_new_tokens)
            fusion = warm.fusion
            forced = TeacherForced.compare(
                reference.forced, teacher_forced_logits(engine.model, fusion.cache, fusion.logits, reference.answer_ids)
            )
            completion = decode(engine, fusion.cache, fusion.logits, GenerationConfig(max_new_tokens=max_new_tokens))
            answer = completion.text.strip()
            full_rows.append(
                _fidelity_row(reference.ttft, reference.logits, reference.logits, 1.0, 0.0, warm_ids, warm)
            )
            full_rows[-1].update(_answers(reference.answer, reference.answer, example))
            row = _fidelity_row(warm_ttft, fusion.logits, reference.logits, forced.agreement, forced.kl, warm_ids, warm)
            row.update(_answers(answer, reference.answer, example))
            row["cached_tokens"] = warm.usage.cached_tokens
            row["hits"], row["spans"] = warm.plan.hits, len(warm.plan.spans)
            warm_rows.append(row)
            progress(
                f"example {number}/{len(examples)}: {len(warm_ids)} tokens, warm "
                f"{warm.plan.hits}/{len(warm.plan.spans)} spans, KL {row['first_token_kl']:.3f}, "
                f"TF {forced.agreement:.2f}, {reference.ttft / warm_ttft:.1f}x; "
                f"cold {cold_ttft:.2f} s vs full {cold_full:.2f} s"
            )
            checkpoint(_fidelity_results(engine, strategy, examples[:number], full_rows, warm_rows, cold_rows))
        return _fidelity_results(engine, strategy, examples, full_rows, warm_rows, cold_rows)
    finally:
        store.close()
        folder.cleanup()


def _fidelity_row(ttft, logits, reference_logits, agreement, forced_kl, ids, fused: FusedPassages) -> dict:
    layout = fused.fusion.layout
    return {
        "ttft_s": ttft,
        "load_s": 0.0,
        "first_token_kl": next_token_kl(reference_logits, logits),
        "top1_equal": int(logits.argmax()) == int(reference_logits.argmax()),
        "teacher_forced_agreement": agreement,
        "teacher_forced_kl": forced_kl,
        "prompt_tokens": len(ids),
        "document_tokens": layout.num_document_tokens,
        "recomputed_tokens": fused.fusion.recomputed_tokens if logits is not reference_logits else 0,
    }


def _answers(answer: str, reference: str, example: Example) -> dict:
    return {
        "answer": answer,
        "answer_agreement": token_f1(answer, [reference]),
        "answer_exact": normalize_answer(answer) == normalize_answer(reference),
        "gold_f1": token_f1(answer, example.answers),
    }


def _fidelity_results(engine, strategy, examples, full_rows, warm_rows, cold_rows) -> dict:
    warm = summarize(warm_rows, full_rows)
    warm["cached_share"] = statistics.fmean(r["cached_tokens"] / r["prompt_tokens"] for r in warm_rows)
    warm["span_hit_rate"] = sum(r["hits"] for r in warm_rows) / max(1, sum(r["spans"] for r in warm_rows))
    cold_total = sum(r["ttft_s"] for r in cold_rows)
    return {
        **_context(engine, strategy),
        "examples": len(examples),
        "passages_per_example": statistics.fmean(len(e.passages) for e in examples),
        "warm": warm,
        "cold": {
            "ttft_total_s": cold_total,
            "full_ttft_total_s": sum(r["full_ttft_s"] for r in cold_rows),
            "slowdown_total": cold_total / sum(r["full_ttft_s"] for r in cold_rows),
            "slowdown_median": statistics.median(r["ttft_s"] / r["full_ttft_s"] for r in cold_rows),
            "first_token_kl": statistics.fmean(r["first_token_kl"] for r in cold_rows),
        },
        "per_example": {"warm": warm_rows, "full": full_rows, "cold": cold_rows},
    }


def _context(engine: Engine, strategy: FusionStrategy) -> dict:
    return {
        "strategy": strategy.name,
        "dtype": str(engine.model.dtype).removeprefix("torch."),
        "torch_threads": torch.get_num_threads(),
        "machine": platform.processor() or platform.machine(),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }


def pool_kv_bytes(engine: Engine, pool: list[str]) -> int:
    """Bytes the store's format takes for every passage of the pool (one passage measured,
    scaled by tokens)."""
    sample = engine.tokenize(pool[0].strip())[:256]
    keys = torch.zeros(engine.spec.num_layers, engine.spec.num_kv_heads, len(sample), engine.spec.head_dim)
    packed = engine.kv_format.pack(keys, keys.clone())
    per_token = sum(t.numel() * t.element_size() for t in packed.values()) / len(sample)
    return int(per_token * sum(len(engine.tokenize(p.strip())) for p in pool))


@dataclass(frozen=True)
class PoolWorkload:
    """The sustained workload: queries pasting `passages_per_query` pool passages each, drawn
    as PoolDraws says, the store capped at `capacity_share` of the pool."""

    queries: int = 500
    passages_per_query: tuple[int, int] = (6, 10)
    capacity_share: float = 0.25
    zipf: float = 0.0
    one_off_blocks: int = 0
    shift_at: int | None = None

    def __post_init__(self) -> None:
        low, high = self.passages_per_query
        if self.queries < 1 or not 1 <= low <= high or not 0 < self.capacity_share <= 1:
            raise ValueError("need >= 1 query, 1 <= min <= max passages and 0 < capacity share <= 1")
        if self.zipf < 0 or self.one_off_blocks < 0 or (self.shift_at is not None and self.shift_at < 1):
            raise ValueError("need a Zipf exponent >= 0, one-off blocks >= 0 and a shift's query >= 1")

    def draws(self, pool: list[str], seed: int) -> PoolDraws:
        return PoolDraws(pool, seed, self.zipf, self.one_off_blocks, self.shift_at)

    def settings(self) -> dict:
        return {"zipf": self.zipf, "one_off_blocks": self.one_off_blocks, "shift_at": self.shift_at}


class PoolDraws:
    """Which passages a query pastes: uniform over the pool (`zipf` 0), or by a Zipf law of
    exponent `zipf` over a random ranking of the pool, as retrieval makes a few passages
    recur (from query `shift_at` on, a new ranking: what was popular is no longer);
    `one_off` blocks per query are pasted by that query alone (sentences of random pool
    passages shuffled: a user's own document, a chat history)."""

    def __init__(
        self, pool: list[str], seed: int, zipf: float = 0.0, one_off: int = 0, shift_at: int | None = None
    ) -> None:
        if zipf < 0 or one_off < 0 or (shift_at is not None and shift_at < 1):
            raise ValueError("the Zipf exponent and the one-off blocks must be >= 0, a shift's query >= 1")
        self.pool, self.zipf, self.one_off, self.shift_at = pool, zipf, one_off, shift_at
        self.rng = random.Random(seed)
        self._numpy = np.random.default_rng(seed)
        self._weights = self._ranking()
        self._queries = 0

    def _ranking(self) -> np.ndarray:
        ranks = self._numpy.permutation(len(self.pool)) + 1
        weights = 1.0 / ranks.astype(float) ** self.zipf
        return weights / weights.sum()

    def query(self, passages_per_query: tuple[int, int], questions: int) -> tuple[list[str], int]:
        """The next query: the passages it pastes and the index of its question."""
        pasted = self.passages(self.rng.randint(*passages_per_query))
        return pasted, self.rng.randrange(questions)

    def passages(self, count: int) -> list[str]:
        self._queries += 1
        if self._queries == self.shift_at:
            self._weights = self._ranking()
        if self.zipf == 0:  # the uniform draws of runs made before Zipf draws existed
            chosen = self.rng.sample(range(len(self.pool)), count)
        else:
            chosen = self._numpy.choice(len(self.pool), size=count, replace=False, p=self._weights).tolist()
        pasted = [self.pool[i] for i in chosen]
        for _ in range(self.one_off):
            sentences = [s for i in self.rng.sample(range(len(self.pool)), 3) for s in self.pool[i].split(". ")]
            self.rng.shuffle(sentences)
            block = " ".join(". ".join(sentences).split()[:120])
            pasted.insert(self.rng.randint(0, len(pasted)), block)
        return pasted


def run_sustained(
    engine: Engine,
    pool: list[str],
    questions: list[str],
    strategy: FusionStrategy,
    workload: PoolWorkload = PoolWorkload(),
    *,
    protected_share: float = DEFAULT_PROTECTED_SHARE,
    window: int = 50,
    seed: int = 0,
    progress: Callable[[str], None] = lambda message: None,
    checkpoint: Callable[[dict], None] = lambda partial: None,
) -> dict:
    """Queries over the pool with the store capped at the workload's share of its KV, a
    `protected_share` of it for passages read since stored (0: plain LRU)."""
    pool_bytes = pool_kv_bytes(engine, pool)
    capacity = max(1, int(workload.capacity_share * pool_bytes))
    folder = tempfile.TemporaryDirectory(prefix="ragkv-sustained-")
    store = open_store(f"lmdb://{folder.name}/store?capacity={capacity}&protected={protected_share}")
    draws = workload.draws(pool, seed)
    settings = {**workload.settings(), "protected_share": protected_share}
    rows: list[dict] = []

    def results() -> dict:
        return _sustained_results(engine, strategy, pool, pool_bytes, capacity, store, rows, window, settings)

    try:
        passages = PromptPassages(engine, store)
        fuse_prompt(passages, stuffed_ids(engine, pool[:2], "warm-up"), strategy, 1)
        for number in range(1, workload.queries + 1):
            pasted, question = draws.query(workload.passages_per_query, len(questions))
            ids = stuffed_ids(engine, pasted, questions[question])
            fused, ttft = fuse_prompt(passages, ids, strategy, 1)
            plan = fused.plan
            rows.append(
                {
                    "query": number,
                    "spans": len(plan.spans),
                    "hits": plan.hits,
                    "prompt_tokens": len(ids),
                    "cached_tokens": fused.usage.cached_tokens,
                    "ttft_s": ttft,
                }
            )
            if number % window == 0:
                summary = _window(rows[-window:])
                progress(
                    f"queries {number - window + 1}-{number}: hit rate {summary['span_hit_rate']:.3f}, cached "
                    f"{summary['cached_share']:.3f}, TTFT p50 {summary['ttft_p50_s']:.2f} s"
                )
                checkpoint(results())
        return results()
    finally:
        store.close()
        folder.cleanup()


def span_hit_rate(rows: list[dict]) -> float:
    """Spans the store held over spans looked up, over `rows` (per query: `hits`, `spans`)."""
    return sum(r["hits"] for r in rows) / max(1, sum(r["spans"] for r in rows))


def _window(rows: list[dict]) -> dict:
    return {
        "queries": [rows[0]["query"], rows[-1]["query"]],
        "span_hit_rate": span_hit_rate(rows),
        "cached_share": sum(r["cached_tokens"] for r in rows) / sum(r["prompt_tokens"] for r in rows),
        "ttft_p50_s": statistics.median(r["ttft_s"] for r in rows),
        "ttft_mean_s": statistics.fmean(r["ttft_s"] for r in rows),
    }


def _sustained_results(engine, strategy, pool, pool_bytes, capacity, store, rows, window, settings) -> dict:
    stats = store.stats()
    windows = [_window(rows[i : i + window]) for i in range(0, len(rows) - window + 1, window)]
    results = {
        **_context(engine, strategy),
        "pool_passages": len(pool),
        "pool_kv_bytes": pool_bytes,
        "store_capacity_bytes": capacity,
        **settings,
        "queries": len(rows),
        "windows": windows,
        "store_evictions": stats.evictions,
        "per_query": rows,
    }
    if len(rows) >= 200:
        results["hit_rate_queries_101_200"] = span_hit_rate(rows[100:200])
        results["hit_rate_last_100"] = span_hit_rate(rows[-100:])
        results["hit_rate_trend"] = hit_rate_trend(rows[100:])
    return results


def hit_rate_trend(rows: list[dict]) -> dict:
    """Least-squares slope of the per-query span hit rate over `rows` (the store full), per
    100 queries, with its standard error: a decay shows as a slope below zero by more than
    two errors, where two windows of 100 draws differ by chance (about 0.015 each at 0.25)."""
    x = np.array([r["query"] for r in rows], dtype=float)
    y = np.array([r["hits"] / max(1, r["spans"]) for r in rows])
    if len(rows) < 3 or np.ptp(x) == 0:
        return {"slope_per_100": 0.0, "stderr_per_100": float("inf"), "queries": len(rows)}
    slope, intercept = np.polyfit(x, y, 1)
    residual = y - (slope * x + intercept)
    stderr = np.sqrt(residual @ residual / (len(x) - 2) / ((x - x.mean()) @ (x - x.mean())))
    return {"slope_per_100": float(slope * 100), "stderr_per_100": float(stderr * 100), "queries": len(rows)}
