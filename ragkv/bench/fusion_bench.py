"""`ragkv bench fusion`: fusion strategies against the full prefill, per example.

Passages are ingested as documents first (not timed), and every strategy runs once on a
short prompt to warm up. Then for each example the full prefill runs once as the
reference, timed as the prefill alone (it needs only the token ids, no stored KV), and
each strategy is timed from the store read to the first token (TTFT = load + fuse).

Figures per strategy, over the examples:
  first_token_kl      mean KL(full || strategy) of the first-token distributions, in nats
  top1_agreement      share of examples whose greedy first token equals full's
  answer_agreement    mean token-F1 (SQuAD normalisation) of the strategy's greedy answer
                      against the full prefill's greedy answer, same max_new_tokens
  answer_exact        share of examples whose normalised answer equals full's
  gold_f1             mean token-F1 against the dataset's gold answers
  speedup_total       sum of full's TTFTs / sum of the strategy's (same examples, same run)
  speedup_median      median of full's TTFTs / median of the strategy's
Every per-example figure is kept under "per_example" so the summary can be recomputed.
"""

from __future__ import annotations

import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ragkv.app.runtime import Runtime
from ragkv.bench.datasets import Example
from ragkv.bench.metrics import kl_divergence, normalize_answer, token_f1
from ragkv.engine.generation import GenerationConfig
from ragkv.engine.spec_string import spec_of
from ragkv.fusion import FusionInput, FusionResult, FusionStrategy, build_strategy

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


def _ingest_passages(runtime: Runtime, examples: list[Example], progress: Callable[[str], None]) -> list[list[str]]:
    doc_ids = []
    for number, example in enumerate(examples, start=1):
        progress(f"ingesting passages of example {number}/{len(examples)}")
        ids = []
        for index, passage in enumerate(example.passages):
            result = runtime.ingestor.ingest_text(passage, f"ex{number}-p{index}", tenant=BENCH_TENANT)
            ids.append(result.doc_id)
        doc_ids.append(ids)
    return doc_ids


def _decode(runtime: Runtime, result: FusionResult, max_new_tokens: int) -> str:
    config = GenerationConfig(max_new_tokens=max_new_tokens)
    return "".join(event.text for event in runtime.engine.stream(result.cache, result.logits, config)).strip()


class _Runner:
    """Loads one example's chunks and fuses them with a strategy, timing both."""

    def __init__(self, runtime: Runtime, example: Example, ids: list[str], max_new_tokens: int, chunk_limit: int | None = None):
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
        fusion_input = FusionInput(self.segments.prefix_ids, chunks, self.segments.question_ids,
                                   len(engine.chunk_prefix_ids), self.segments.question_text_span)
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
    progress: Callable[[str], None] = lambda message: None,
    checkpoint: Callable[[dict], None] = lambda partial: None,
) -> dict:
    """The figures over `examples`; `checkpoint` receives them after every example (long
    runs keep what they measured when stopped)."""
    doc_ids = _ingest_passages(runtime, examples, progress)
    reference = build_strategy(REFERENCE)
    progress("warming up")
    warmup = _Runner(runtime, examples[0], doc_ids[0], max_new_tokens, chunk_limit=2)
    for strategy in [reference, *(variant.strategy for variant in variants)]:
        warmup.fuse(strategy)
    rows: dict[str, list[dict]] = {REFERENCE: [], **{variant.label: [] for variant in variants}}
    for number, (example, ids) in enumerate(zip(examples, doc_ids), start=1):
        progress(f"example {number}/{len(examples)}")
        runner = _Runner(runtime, example, ids, max_new_tokens)
        full, full_ttft, _ = runner.fuse(reference)
        full_answer = _decode(runtime, full, max_new_tokens)
        rows[REFERENCE].append(_row(full, full, full_ttft, 0.0, full_answer, full_answer, example))
        for variant in variants:
            result, ttft, load = runner.fuse(variant.strategy)
            answer = _decode(runtime, result, max_new_tokens)
            rows[variant.label].append(_row(result, full, ttft, load, answer, full_answer, example))
            progress(f"  {variant.label}: KL {rows[variant.label][-1]['first_token_kl']:.3f}, "
                     f"{full_ttft / ttft:.1f}x, answer {answer[:60]!r} (full {full_answer[:60]!r})")
        checkpoint(_results(runtime, examples[:number], variants, rows, max_new_tokens))
    return _results(runtime, examples, variants, rows, max_new_tokens)


def _results(runtime: Runtime, examples: list[Example], variants: list[Variant], rows: dict[str, list[dict]],
             max_new_tokens: int) -> dict:
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


def _row(result: FusionResult, reference: FusionResult, ttft: float, load: float, answer: str, reference_answer: str,
         example: Example) -> dict:
    return {
        "ttft_s": ttft,
        "load_s": load,
        "first_token_kl": kl_divergence(reference.logits, result.logits),
        "top1_equal": int(result.logits.argmax()) == int(reference.logits.argmax()),
        "answer": answer,
        "answer_agreement": token_f1(answer, [reference_answer]),
        "answer_exact": normalize_answer(answer) == normalize_answer(reference_answer),
        "gold_f1": token_f1(answer, example.answers),
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
        "prompt_tokens": mean("prompt_tokens"),
        "recomputed_tokens": mean("recomputed_tokens"),
        "recomputed_share": sum(row["recomputed_tokens"] for row in rows) / sum(row["document_tokens"] for row in rows),
    }
    for key in sorted({key for row in rows for key in row if key.startswith("selection_")}):
        summary[key] = mean(key)
    return summary
