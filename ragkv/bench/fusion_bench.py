"""`ragkv bench fusion`: every fusion strategy against the full prefill, per example.

Passages are ingested as documents first (not timed). Then for each example the full
prefill runs once as the reference, and each strategy is timed from the store read to
the first token (TTFT = load + fuse) and compared with the reference: first-token KL and
top-1 agreement, answer F1 against the gold answers and against the full answer.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from ragkv.bench.datasets import Example
from ragkv.bench.metrics import kl_divergence, token_f1
from ragkv.bench.specs import parse_variant
from ragkv.fusion import FusionConfig, FusionInput, FusionResult
from ragkv.engine.generation import GenerationConfig
from ragkv.app.runtime import Runtime

BENCH_TENANT = "bench"


def parse_strategy(spec: str, ratio: float) -> tuple[str, FusionConfig]:
    """'a3' or 'a3:head_aggregation=normalized,exclude_sinks=true' -> (label, config)."""
    name, values = parse_variant(spec, FusionConfig, name_prefix=True)
    return spec, FusionConfig(**{"strategy": name, "ratio": ratio, **values})


@dataclass
class StrategyTally:
    ttft: list[float] = field(default_factory=list)
    load: list[float] = field(default_factory=list)
    kl: list[float] = field(default_factory=list)
    top1: list[float] = field(default_factory=list)
    gold_f1: list[float] = field(default_factory=list)
    agreement_f1: list[float] = field(default_factory=list)
    speedup: list[float] = field(default_factory=list)
    recomputed: list[int] = field(default_factory=list)
    prompt_tokens: list[int] = field(default_factory=list)

    def summary(self) -> dict[str, float]:
        mean = lambda values: float(statistics.fmean(values)) if values else float("nan")  # noqa: E731
        return {
            "examples": len(self.ttft),
            "ttft_s": mean(self.ttft),
            "load_s": mean(self.load),
            "first_token_kl": mean(self.kl),
            "top1_agreement": mean(self.top1),
            "gold_f1": mean(self.gold_f1),
            "agreement_f1": mean(self.agreement_f1),
            "speedup": mean(self.speedup),
            "recomputed_tokens": mean(self.recomputed),
            "prompt_tokens": mean(self.prompt_tokens),
        }


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


def run_fusion_bench(
    runtime: Runtime,
    examples: list[Example],
    strategies: list[tuple[str, FusionConfig]],
    *,
    max_new_tokens: int = 32,
    progress: Callable[[str], None] = lambda message: None,
) -> dict:
    doc_ids = _ingest_passages(runtime, examples, progress)
    engine, rag = runtime.engine, runtime.rag
    tallies = {label: StrategyTally() for label, _ in [("full", None), *strategies]}
    reference_strategy = FusionConfig(strategy="full").build()
    for number, (example, ids) in enumerate(zip(examples, doc_ids), start=1):
        progress(f"example {number}/{len(examples)}")
        retrieved = [(record, chunk, 0.0) for record in (runtime.registry.get(BENCH_TENANT, d) for d in ids) for chunk in record.chunks]
        segments = engine.prompt.rag_segments(example.question)

        def fuse(strategy) -> tuple[FusionResult, float, float]:
            started = time.perf_counter()
            chunks, _ = rag.load_chunks(BENCH_TENANT, retrieved)
            loaded = time.perf_counter()
            fusion_input = FusionInput(segments.prefix_ids, chunks, segments.question_ids,
                                       len(engine.chunk_prefix_ids), segments.question_text_span)
            result = strategy.fuse(engine.model, fusion_input, engine.chunk_prefix_cache(), max_new_tokens)
            return result, time.perf_counter() - started, loaded - started

        reference, reference_ttft, reference_load = fuse(reference_strategy)
        reference_answer = _decode(runtime, reference, max_new_tokens)
        _record(tallies["full"], reference, reference, reference_ttft, reference_load, reference_answer, reference_answer, example, reference_ttft)
        for label, config in strategies:
            result, ttft, load = fuse(config.build())
            answer = _decode(runtime, result, max_new_tokens)
            _record(tallies[label], result, reference, ttft, load, answer, reference_answer, example, reference_ttft)
    return {
        "examples": len(examples),
        "passages_per_example": statistics.fmean(len(e.passages) for e in examples),
        "strategies": {label: tally.summary() for label, tally in tallies.items()},
        "configs": {label: dataclasses.asdict(config) for label, config in strategies},
    }


def _record(tally, result, reference, ttft, load, answer, reference_answer, example, reference_ttft) -> None:
    tally.ttft.append(ttft)
    tally.load.append(load)
    tally.kl.append(kl_divergence(reference.logits, result.logits))
    tally.top1.append(float(int(result.logits.argmax()) == int(reference.logits.argmax())))
    tally.gold_f1.append(token_f1(answer, example.answers))
    tally.agreement_f1.append(token_f1(answer, [reference_answer]))
    tally.speedup.append(reference_ttft / ttft)
    tally.recomputed.append(result.recomputed_tokens)
    tally.prompt_tokens.append(result.layout.length)
