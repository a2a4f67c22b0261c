"""`ragkv bench fusion`: fusion strategies against the full prefill, per example.

Each example's passages are ingested as documents just before it runs (not timed), and
every strategy runs once on a short prompt to warm up. Then for each example the full prefill runs once as the
reference, timed as the prefill alone (it needs only the token ids, no stored KV), and
each strategy is timed from the store read to the first token (TTFT = load + fuse).

Figures per strategy, over the examples:
  first_token_kl      mean KL(full || strategy) of the first-token distributions, in nats
  top1_agreement      share of examples whose greedy first token equals full's
  answer_agreement    mean token-F1 (SQuAD normalisation) of the strategy's greedy answer
                      against the full prefill's greedy answer, same max_new_tokens
  answer_exact        share of examples whose normalised answer equals full's
  teacher_forced_agreement  share of answer positions whose argmax equals full's token,
                      with full's greedy answer fed through the strategy's cache
                      (ragkv.fusion.fidelity); mean over examples
  teacher_forced_kl   mean over examples of the mean KL(full || strategy) over those positions
  gold_f1             mean token-F1 against the dataset's gold answers
  speedup_total       sum of full's TTFTs / sum of the strategy's (same examples, same run)
  speedup_median      median of full's TTFTs / median of the strategy's
Each fidelity figure also has its spread over the examples (min, p25, median, p75, max).
Every per-example figure is kept under "per_example" so the summary can be recomputed.
"""

from __future__ import annotations

import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

from ragkv.app.generate import decode, forced_answer_ids
from ragkv.app.runtime import Runtime
from ragkv.bench.datasets import Example
from ragkv.bench.metrics import normalize_answer, token_f1
from ragkv.bench.weight_fidelity import run_weight_fidelity
from ragkv.engine.generation import GenerationConfig
from ragkv.engine.spec_string import spec_of
from ragkv.fusion import FusionInput, FusionResult, FusionStrategy, build_strategy
from ragkv.fusion.fidelity import TeacherForced, next_token_kl, teacher_forced_logits

BENCH_TENANT = "bench"
REFERENCE = "full"


@dataclass(frozen=True)
class Variant:
    label: str
    """The spec as given on the command line."""
    strategy: FusionStrategy


def parse_variants(specs: list[str]) -> list[Variant]:
    """Spec strings ('a3', 'a3:ratio=0.3,deviation_share=0') -> variants; 'full' is the
    reference and always runs, so it is refused here."""
    variants = []
    for spec in specs:
        strategy = build_strategy(spec)
        if spec.strip() == REFERENCE:
            raise ValueError("'full' is the reference and always runs; list only the strategies to compare")
        variants.append(Variant(spec.strip(), strategy))
    if len({variant.label for variant in variants}) != len(variants):
        raise ValueError("a strategy spec is listed twice")
    return variants


@dataclass
class IngestionCost:
    """What ingesting the bench's passages cost, the in-context recompute apart."""

    context_neighbours: int
    documents: int = 0
    tokens: int = 0
    ingest_s: float = 0.0
    context_chunks: int = 0
    context_tokens_placed: int = 0
    context_s: float = 0.0

    def to_json(self) -> dict:
        return {**asdict(self), "tokens_per_s": self.tokens / max(self.ingest_s + self.context_s, 1e-9)}


def _ingest_passages(runtime: Runtime, example: Example, number: int, cost: IngestionCost) -> list[str]:
    """The example's passages as documents; with context neighbours configured, their chunks
    are then recomputed in context (the neighbours are found among every passage ingested
    so far, this example's own included: a RAG corpus's related passages)."""
    results = [
        runtime.ingestor.ingest_text(passage, f"ex{number}-p{index}", tenant=BENCH_TENANT)
        for index, passage in enumerate(example.passages)
    ]
    doc_ids = [result.doc_id for result in results]
    context = runtime.contextualize(BENCH_TENANT, doc_ids)
    cost.documents += len(results)
    cost.tokens += sum(result.tokens for result in results)
    cost.ingest_s += sum(result.seconds for result in results)
    if context is not None:
        cost.context_chunks += context.chunks
        cost.context_tokens_placed += context.context_tokens
        cost.context_s += context.seconds
    return doc_ids


def _decode(runtime: Runtime, result: FusionResult, max_new_tokens: int) -> tuple[str, list[int]]:
    """The greedy answer and its token ids (the last may be EOS); the cache is left at the prompt."""
    config = GenerationConfig(max_new_tokens=max_new_tokens)
    completion = decode(runtime.engine, result.cache, result.logits, config)
    result.cache.truncate(result.layout.length)
    return completion.text.strip(), forced_answer_ids(completion)


class _Runner:
    """Loads one example's chunks and fuses them with a strategy, timing both."""

    def __init__(
        self, runtime: Runtime, example: Example, ids: list[str], max_new_tokens: int, chunk_limit: int | None = None
    ):
        self.runtime, self.max_new_tokens = runtime, max_new_tokens
        records = (runtime.registry.get(BENCH_TENANT, doc_id) for doc_id in ids)
        self.retrieved = [(record, chunk, 0.0) for record in records for chunk in record.chunks][:chunk_limit]
        self.segments = runtime.engine.prompt.rag_segments(example.question)

    def fuse(self, strategy: FusionStrategy) -> tuple[FusionResult, float, float]:
        """(result, TTFT, load seconds). The full prefill reads nothing from the store, so
        neither its load nor its fusion input's KV counts in its TTFT."""
        engine = self.runtime.engine
        started = time.perf_counter()
        chunks, _ = self.runtime.rag.load_chunks(BENCH_TENANT, self.retrieved)
        load = time.perf_counter() - started
        fusion_input = FusionInput(
            self.segments.prefix_ids,
            chunks,
            self.segments.question_ids,
            len(engine.chunk_prefix_ids),
            self.segments.question_text_span,
        )
        fuse_started = time.perf_counter()
        result = strategy.fuse(engine.model, fusion_input, engine.chunk_prefix_cache(), self.max_new_tokens)
        fuse = time.perf_counter() - fuse_started
        if not strategy.reuses_stored_kv:
            return result, fuse, 0.0
        return result, load + fuse, load


def run_fusion_bench(
    runtime: Runtime,
    examples: list[Example],
    variants: list[Variant],
    *,
    max_new_tokens: int = 32,
    weight_formats: list[str] = (),
    progress: Callable[[str], None] = lambda message: None,
    checkpoint: Callable[[dict], None] = lambda partial: None,
) -> dict:
    """The figures over `examples`; `checkpoint` receives them after every example (long
    runs keep what they measured when stopped). `weight_formats` (int8, int4, served, ...)
    adds the full prefill's figures per decode-weight format against float32
    (ragkv.bench.weight_fidelity) on the same prompts."""
    reference = build_strategy(REFERENCE)
    cost = IngestionCost(runtime.config.ingest.context_neighbours)
    progress("ingesting the passages of example 1 and warming up")
    # each example's passages are ingested just before it runs, so a stopped run keeps
    # the examples it finished (checkpoint)
    doc_ids = {1: _ingest_passages(runtime, examples[0], 1, cost)}
    warmup = _Runner(runtime, examples[0], doc_ids[1], max_new_tokens, chunk_limit=2)
    for strategy in [reference, *(variant.strategy for variant in variants)]:
        warmup.fuse(strategy)
    rows: dict[str, list[dict]] = {REFERENCE: [], **{variant.label: [] for variant in variants}}
    prompts: list[list[int]] = []
    for number, example in enumerate(examples, start=1):
        progress(f"example {number}/{len(examples)}")
        ids = doc_ids.pop(number) if number in doc_ids else _ingest_passages(runtime, example, number, cost)
        runner = _Runner(runtime, example, ids, max_new_tokens)
        full, full_ttft, _ = runner.fuse(reference)
        full_answer, answer_ids = _decode(runtime, full, max_new_tokens)
        full_forced = teacher_forced_logits(runtime.engine.model, full.cache, full.logits, answer_ids)
        prompts.append(full.layout.token_ids.tolist())
        forced = TeacherForced.compare(full_forced, full_forced)
        rows[REFERENCE].append(_row(full, full, full_ttft, 0.0, full_answer, full_answer, example, forced))
        for variant in variants:
            result, ttft, load = runner.fuse(variant.strategy)
            forced = TeacherForced.compare(
                full_forced, teacher_forced_logits(runtime.engine.model, result.cache, result.logits, answer_ids)
            )
            answer, _ = _decode(runtime, result, max_new_tokens)
            rows[variant.label].append(_row(result, full, ttft, load, answer, full_answer, example, forced))
            progress(
                f"  {variant.label}: KL {rows[variant.label][-1]['first_token_kl']:.3f}, "
                f"forced {forced.agreement:.2f}/{forced.kl:.3f}, {full_ttft / ttft:.1f}x, "
                f"answer {answer[:60]!r} (full {full_answer[:60]!r})"
            )
        checkpoint(_results(runtime, examples[:number], variants, rows, max_new_tokens))
    results = _results(runtime, examples, variants, rows, max_new_tokens)
    results["ingestion"] = cost.to_json()
    if weight_formats:
        results["weights"] = run_weight_fidelity(
            runtime.engine.config, prompts, list(weight_formats), max_new_tokens=max_new_tokens, progress=progress
        )
    return results


def _results(
    runtime: Runtime, examples: list[Example], variants: list[Variant], rows: dict[str, list[dict]], max_new_tokens: int
) -> dict:
    return {
        "examples": len(examples),
        "passages_per_example": statistics.fmean(len(e.passages) for e in examples),
        "max_new_tokens": max_new_tokens,
        "dtype": str(runtime.engine.model.dtype).removeprefix("torch."),
        "torch_threads": torch.get_num_threads(),
        "machine": platform.processor() or platform.machine(),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "strategies": {label: summarize(values, rows[REFERENCE]) for label, values in rows.items()},
        "specs": {REFERENCE: REFERENCE, **{variant.label: spec_of(variant.strategy) for variant in variants}},
        "per_example": rows,
    }


def _row(
    result: FusionResult,
    reference: FusionResult,
    ttft: float,
    load: float,
    answer: str,
    reference_answer: str,
    example: Example,
    forced: TeacherForced,
) -> dict:
    return {
        "ttft_s": ttft,
        "load_s": load,
        "first_token_kl": next_token_kl(reference.logits, result.logits),
        "top1_equal": int(result.logits.argmax()) == int(reference.logits.argmax()),
        "answer": answer,
        "answer_agreement": token_f1(answer, [reference_answer]),
        "answer_exact": normalize_answer(answer) == normalize_answer(reference_answer),
        "gold_f1": token_f1(answer, example.answers),
        "teacher_forced_agreement": forced.agreement,
        "teacher_forced_kl": forced.kl,
        "teacher_forced_kl_max": forced.kl_max,
        "answer_tokens": forced.positions,
        "prompt_tokens": result.layout.length,
        "document_tokens": result.layout.num_document_tokens,
        "recomputed_tokens": result.recomputed_tokens,
        **{f"selection_{key}": value for key, value in result.selection.items()},
    }


def summarize(rows: list[dict], reference_rows: list[dict]) -> dict[str, float]:
    """The per-strategy figures the module docstring defines."""

    def mean(key: str) -> float:
        return float(statistics.fmean(float(row[key]) for row in rows))

    ttfts = [row["ttft_s"] for row in rows]
    reference_ttfts = [row["ttft_s"] for row in reference_rows]
    summary = {
        "examples": len(rows),
        "ttft_total_s": sum(ttfts),
        "ttft_median_s": statistics.median(ttfts),
        "load_mean_s": mean("load_s"),
        "speedup_total": sum(reference_ttfts) / sum(ttfts),
        "speedup_median": statistics.median(reference_ttfts) / statistics.median(ttfts),
        "first_token_kl": mean("first_token_kl"),
        "first_token_kl_median": statistics.median(row["first_token_kl"] for row in rows),
        "top1_agreement": mean("top1_equal"),
        "answer_agreement": mean("answer_agreement"),
        "answer_exact": mean("answer_exact"),
        "gold_f1": mean("gold_f1"),
        "teacher_forced_agreement": mean("teacher_forced_agreement"),
        "teacher_forced_kl": mean("teacher_forced_kl"),
        "prompt_tokens": mean("prompt_tokens"),
        "recomputed_tokens": mean("recomputed_tokens"),
        "recomputed_share": sum(row["recomputed_tokens"] for row in rows) / sum(row["document_tokens"] for row in rows),
    }
    for key in sorted({key for row in rows for key in row if key.startswith("selection_")}):
        summary[key] = mean(key)
    for key in SPREAD_KEYS:
        summary[f"{key}_spread"] = spread([float(row[key]) for row in rows])
    return summary


SPREAD_KEYS = ("first_token_kl", "teacher_forced_agreement", "teacher_forced_kl", "answer_agreement")


def spread(values: list[float]) -> dict[str, float]:
    """min, p25, median, p75, max (linear interpolation between order statistics)."""
    quantiles = torch.tensor(values, dtype=torch.float64).quantile(
        torch.tensor([0.0, 0.25, 0.5, 0.75, 1.0], dtype=torch.float64)
    )
    return dict(zip(("min", "p25", "median", "p75", "max"), (float(q) for q in quantiles)))
