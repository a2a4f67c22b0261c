"""`ragkv bench sparse`: retrieval-based sparse decode selectors against dense decode.

Quality, per example: the prompt is [prefix | passages | question], built the way users
get it (path 'user', the default): every passage is encoded as ingestion stores it
(pre-RoPE K/V and its A2ATS codes, through the store's blob format), the chunks are fused
with the question by the fusion strategy (default a3), and the selector reads the stored
codes for every row the fusion reused (fresh codes only for recomputed, prefix and
question rows), as the query path does. Path 'prefill' uses a plain prefill instead.
Every selector decodes its own answer greedily; at every step, layer and KV head its choice
is compared with the oracle's (the top-k rows by exact attention mass, summed over the
head's query heads) among the same candidate rows:

    recall = mass on the selector's retrieved rows / mass on the oracle's retrieved rows

(sinks and the recent window are excluded from both, so recall is not inflated by the
rows every selector keeps). Also reported: `mass_recall`, the same ratio over ALL attended
rows (sinks + window + retrieved, against sinks + window + the oracle's rows), the
looser figure papers usually quote; `kept_mass`, the share of the exact attention mass
on all attended rows; answer F1 against the dense answer and against the gold answers.
The selectors decode through the forward loop (the observer that measures recall needs
it), and so does the dense answer they are compared with (the `dense` selector): against
the compiled step's answer the F1 would also count the two paths' rounding, which on a
tiny random model flips near-tied greedy tokens.

Speed, per context length: passages are concatenated (repeated when short) to the
longest length and prefilled once; each shorter context is a prefix of that cache
(causal, so exactly its own prefill). Every selector then decodes `timing_steps` tokens
(teacher-forced on the text) through the engine's own decode step, interleaved step by
step with the others; ms/token is the median whole step after `warmup_steps`, and the
speed-up is over the engine's default dense decode in the same run. Each row says which
step ran: 'compiled' (ragkv.engine.compiled_decode, which runs A2ATS itself) or 'python'
(the forward loop, for the other selectors). Setup (per-request k-means, factor fits,
codes of fresh rows) is timed apart.

Auxiliary memory: bytes per cached token held by the selector (codes, factors) over all
layers and KV heads, as a fraction of the KV bytes per token in fp16; fixed state
(codebooks, centroids) is reported apart.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from ragkv.app.generate import decode
from ragkv.bench.datasets import Example
from ragkv.bench.metrics import token_f1
from ragkv.engine import Engine
from ragkv.engine.generation import GenerationConfig
from ragkv.engine.kv_cache import KVCache
from ragkv.engine.spec_string import split_spec
from ragkv.fusion import DEFAULT_STRATEGY, FusionConfig, FusionInput, FusionResult
from ragkv.fusion.layout import LoadedChunk
from ragkv.sparse import PromptState, SparseConfig
from ragkv.sparse.base import Selector
from ragkv.sparse.codebook import A2ATSCodebook
from ragkv.sparse.oracle import attention_mass
from ragkv.sparse.wiring import sparse_attention, sparse_chunk_codes
from ragkv.store.blob import decode_blob, encode_blob

QUESTION_WINDOW = 32


@dataclass
class RecallMeter:
    """Observer for a selector: recall of the oracle's top-k mass and mass kept, per step."""

    scale: float
    recalls: list[float] = field(default_factory=list)
    mass_recalls: list[float] = field(default_factory=list)
    kept: list[float] = field(default_factory=list)

    def __call__(
        self, layer: int, q: torch.Tensor, cache: KVCache, indices: torch.Tensor, start: int, end: int
    ) -> None:
        keys, _ = cache.layer(layer)
        mass = attention_mass(q, keys, self.scale)  # [Hkv, T], rows sum to the group size
        group = q.shape[0] // keys.shape[0]
        chosen = torch.zeros_like(mass, dtype=torch.bool).scatter_(1, indices.long(), True)
        kept = (mass * chosen).sum(1)
        self.kept.extend(kept.div(group).tolist())
        retrieved = chosen[:, start:end]
        k = int(retrieved[0].sum())
        if k == 0 or k == end - start:  # nothing retrieved, or every candidate: no choice was made
            return
        candidates = mass[:, start:end]
        best = candidates.topk(k, dim=-1).values.sum(-1)
        got = (candidates * retrieved).sum(-1)
        self.recalls.extend((got / best.clamp(min=1e-30)).tolist())
        self.mass_recalls.extend((kept / (kept - got + best).clamp(min=1e-30)).tolist())


def mean(values: Sequence[float]) -> float:
    return float(statistics.fmean(values)) if values else float("nan")


def rag_prompt(engine: Engine, example: Example) -> tuple[list[int], int, int]:
    """(token ids, prefix length, question start) of [prefix | passages | question]."""
    segments = engine.prompt.rag_segments(example.question)
    document = [token for passage in example.passages for token in engine.tokenize(passage)]
    ids = segments.prefix_ids + document + segments.question_ids
    return ids, len(segments.prefix_ids), len(segments.prefix_ids) + len(document)


def build(
    config: SparseConfig | None,
    engine: Engine,
    codebook: A2ATSCodebook | None,
    cache: KVCache,
    ids,
    prefix_len: int,
    question_start: int,
) -> Selector | None:
    if config is None:
        return None
    prompt = PromptState.from_prefill(engine.model, cache, ids, prefix_len, question_start)
    return config.build(prompt, codebook)


def decode_answer(engine: Engine, cache: KVCache, logits: torch.Tensor, attention, max_new_tokens: int) -> str:
    return decode(engine, cache, logits, GenerationConfig(max_new_tokens=max_new_tokens), attention).text.strip()


DENSE_REFERENCE = SparseConfig(selector="dense")
"""What the selectors' answers are compared with: dense attention in the forward loop."""

SHARED_OPTIONS = {"head_aggregation": str, "sinks": int, "window": int, "backend": str}
"""SparseConfig fields a bench variant may set next to the selector's own options."""


def selector_config(spec: str, budget: float, base: SparseConfig = SparseConfig()) -> SparseConfig:
    """'a2ats' or a variant 'a2ats:head_aggregation=logits,mean_key=false': the selector's
    own options, plus the shared SHARED_OPTIONS of SparseConfig."""
    name, raw = split_spec(spec)
    shared = {key: raw.pop(key) for key in SHARED_OPTIONS if key in raw}
    selector = name + (":" + ",".join(f"{key}={value}" for key, value in raw.items()) if raw else "")
    values = {key: SHARED_OPTIONS[key](value) for key, value in shared.items()}
    return dataclasses.replace(base, selector=selector, budget=budget, **values)


def ingested_chunks(
    engine: Engine, codebook: A2ATSCodebook | None, example: Example
) -> tuple[list[LoadedChunk], list[dict]]:
    """Each passage as the store holds it after ingestion (encoded, through the blob format),
    and as the query path loads it."""
    stored = [
        decode_blob(encode_blob(engine.encode_chunk(ids, codebook))).tensors
        for ids in (engine.tokenize(passage) for passage in example.passages)
        if ids
    ]
    return [LoadedChunk(t["tokens"].tolist(), *engine.kv_format.unpack(t)) for t in stored], stored


class UserPrompt:
    """One example's fused prompt on the user path: built once, each selector decodes a copy."""

    def __init__(self, engine: Engine, codebook: A2ATSCodebook | None, example: Example, fusion: str, extra: int):
        self.engine, self.codebook, self.extra = engine, codebook, extra
        segments = engine.prompt.rag_segments(example.question)
        self.chunks, self.stored = ingested_chunks(engine, codebook, example)
        fusion_input = FusionInput(
            segments.prefix_ids,
            self.chunks,
            segments.question_ids,
            len(engine.chunk_prefix_ids),
            segments.question_text_span,
        )
        self.result: FusionResult = (
            FusionConfig(strategy=fusion).build().fuse(engine.model, fusion_input, engine.chunk_prefix_cache(), extra)
        )
        self.cache, self.logits = self.result.cache, self.result.logits

    def attention(self, config: SparseConfig, cache: KVCache):
        codes = sparse_chunk_codes(self.engine, self.codebook, config, self.chunks, self.stored)
        fused = dataclasses.replace(self.result, cache=cache)
        return sparse_attention(self.engine, self.codebook, config, fused, codes)


class PrefillPrompt:
    """One example's prompt as a plain prefill of [prefix | passages | question]."""

    def __init__(self, engine: Engine, codebook: A2ATSCodebook | None, example: Example, extra: int):
        self.engine, self.codebook = engine, codebook
        self.ids, self.prefix_len, self.question_start = rag_prompt(engine, example)
        self.cache, self.logits = engine.prefill(self.ids, extra)

    def attention(self, config: SparseConfig, cache: KVCache):
        return build(config, self.engine, self.codebook, cache, self.ids, self.prefix_len, self.question_start)


PATHS = ("user", "prefill")


def run_quality(
    engine: Engine,
    codebook: A2ATSCodebook | None,
    examples: Sequence[Example],
    configs: dict[str, SparseConfig],
    max_new_tokens: int,
    progress: Callable[[str], None],
    path: str = "user",
    fusion: str = DEFAULT_STRATEGY,
) -> dict:
    if path not in PATHS:
        raise ValueError(f"path must be one of {PATHS}, got {path!r}")
    model = engine.model
    rows: dict[str, dict[str, list[float]]] = {
        name: {"recall": [], "mass_recall": [], "kept_mass": [], "f1_dense": [], "f1_gold": []} for name in configs
    }
    prompt_tokens = []
    for number, example in enumerate(examples, start=1):
        progress(f"quality: example {number}/{len(examples)}: {'fusion ' + fusion if path == 'user' else 'prefill'}")
        prompt = (
            UserPrompt(engine, codebook, example, fusion, max_new_tokens + 1)
            if path == "user"
            else PrefillPrompt(engine, codebook, example, max_new_tokens + 1)
        )
        cache, logits = prompt.cache, prompt.logits
        prompt_tokens.append(cache.length)
        reference = cache.clone(max_new_tokens + 1)
        dense_answer = decode_answer(
            engine, reference, logits, prompt.attention(DENSE_REFERENCE, reference), max_new_tokens
        )
        for name, config in configs.items():
            progress(f"quality: example {number}/{len(examples)}: {name}")
            work = cache.clone(max_new_tokens + 1)
            attention = prompt.attention(config, work)
            meter = RecallMeter(model.scale)
            attention.observer = meter
            answer = decode_answer(engine, work, logits, attention, max_new_tokens)
            row = rows[name]
            row["recall"].append(mean(meter.recalls))
            row["mass_recall"].append(mean(meter.mass_recalls))
            row["kept_mass"].append(mean(meter.kept))
            row["f1_dense"].append(token_f1(answer, [dense_answer]))
            row["f1_gold"].append(token_f1(answer, example.answers))
        rows.setdefault("_dense_gold", {"f1_gold": []})["f1_gold"].append(token_f1(dense_answer, example.answers))
    summary = {
        name: {key: mean([v for v in values if not math.isnan(v)]) for key, values in row.items()}
        for name, row in rows.items()
        if not name.startswith("_")
    }
    return {
        "examples": len(examples),
        "path": path,
        "fusion": fusion if path == "user" else None,
        "prompt_tokens": mean(prompt_tokens),
        "dense_f1_gold": mean(rows["_dense_gold"]["f1_gold"]) if "_dense_gold" in rows else float("nan"),
        "selectors": summary,
    }


def long_context_ids(engine: Engine, examples: Sequence[Example], length: int) -> list[int]:
    """[prefix | passages, concatenated and repeated | ...] of at least `length` tokens."""
    ids = list(engine.prompt.prefix_ids)
    passages = [engine.tokenize(passage) for example in examples for passage in example.passages]
    if not any(passages):
        raise ValueError("the examples hold no passage text")
    while len(ids) < length:
        for passage in passages:
            ids.extend(passage)
            if len(ids) >= length:
                break
    return ids


@torch.inference_mode()
def prefill_chunked(engine: Engine, ids: list[int], capacity: int, piece: int = 1024) -> KVCache:
    """Plain prefill in pieces (same result as one prefill; bounded attention memory)."""
    cache = engine.model.new_cache(capacity)
    for start in range(0, len(ids), piece):
        engine.model.prefill(torch.tensor(ids[start : start + piece]), cache)
    return cache


def prefix_cache(cache: KVCache, rows: int, extra: int) -> KVCache:
    keys = cache.keys.new_empty(cache.keys.shape[:2] + (rows + extra,) + cache.keys.shape[3:])
    values = torch.empty_like(keys)
    keys[:, :, :rows] = cache.keys[:, :, :rows]
    values[:, :, :rows] = cache.values[:, :, :rows]
    return KVCache(keys, values, rows, rows)


def run_speed(
    engine: Engine,
    codebook: A2ATSCodebook | None,
    examples: Sequence[Example],
    configs: dict[str, SparseConfig],
    lengths: Sequence[int],
    timing_steps: int,
    warmup_steps: int,
    progress: Callable[[str], None],
) -> dict:
    """Per length, every configuration decodes the same tokens through the engine's own
    decode step (compiled where it covers the selector); steps are interleaved (step i of
    every configuration, then step i + 1) so that load drift on a shared machine hits all
    of them alike; figures are medians over the timed steps."""
    model = engine.model
    steps = timing_steps + warmup_steps
    longest = max(lengths)
    ids = long_context_ids(engine, examples, longest + steps)
    progress(f"speed: prefill of {longest} tokens")
    started = time.perf_counter()
    full = prefill_chunked(engine, ids[:longest], longest)
    prefill_s = time.perf_counter() - started
    prefix_len = len(engine.prompt.prefix_ids)
    results: dict[str, dict] = {}
    for length in sorted(lengths):
        progress(f"speed: {length} tokens: setup")
        runs = {}
        for name, config in [("engine_dense", None), *configs.items()]:
            cache = prefix_cache(full, length, steps + 1)
            setup_started = time.perf_counter()
            # the last rows stand in for the question window (SnapKV, LRQK's query sample)
            attention = build(config, engine, codebook, cache, ids[:length], prefix_len, length - QUESTION_WINDOW)
            setup_s = time.perf_counter() - setup_started
            runs[name] = (cache, attention, setup_s, decode_path(model, attention, cache), [])
        progress(f"speed: {length} tokens: {steps} interleaved decode steps")
        for step in range(steps):
            for cache, attention, _, _, step_times in runs.values():
                t0 = time.perf_counter()
                model.decode_step(ids[length + step], cache, attention)
                if step >= warmup_steps:
                    step_times.append(time.perf_counter() - t0)
        per_length = {
            name: {
                "ms_per_token": 1000 * statistics.median(step_times),
                "ms_per_token_mean": 1000 * mean(step_times),
                "setup_s": setup_s,
                "decode_path": path,
            }
            for name, (_, _, setup_s, path, step_times) in runs.items()
        }
        runs.clear()
        dense = per_length["engine_dense"]
        for row in per_length.values():
            row["speedup"] = dense["ms_per_token"] / row["ms_per_token"]
        results[str(length)] = per_length
    return {"prefill_s": prefill_s, "threads": torch.get_num_threads(), "context_lengths": results}


def decode_path(model, attention: Selector | None, cache: KVCache) -> str:
    """'compiled' when the engine's compiled step runs this attention, else 'python'."""
    if model.compiled_decoder() is None:
        return "python"
    return "compiled" if attention is None or attention.compiled_plan(cache) is not None else "python"


def aux_memory(
    engine: Engine, codebook: A2ATSCodebook | None, configs: dict[str, SparseConfig], examples: Sequence[Example]
) -> dict:
    """Per-token and fixed auxiliary bytes of each selector, built on a short prompt."""
    ids, prefix_len, question_start = rag_prompt(engine, examples[0])
    ids = ids[-min(len(ids), 512) :]
    cache, _ = engine.prefill(ids, 1)
    kv = engine.spec.kv_bytes_per_token
    out = {}
    for name, config in configs.items():
        work = cache.clone(1)
        selector = build(config, engine, codebook, work, ids, 0, len(ids) - 1)
        out[name] = {
            "aux_bytes_per_token": selector.aux_bytes_per_token,
            "aux_fraction_of_kv_fp16": selector.aux_bytes_per_token / kv,
            "fixed_bytes": selector.fixed_bytes,
        }
    return {"kv_bytes_per_token_fp16": kv, "selectors": out}


def run_sparse_bench(
    engine: Engine,
    codebook: A2ATSCodebook | None,
    examples: Sequence[Example],
    speed_examples: Sequence[Example],
    *,
    selectors: Sequence[str],
    budget: float,
    base: SparseConfig = SparseConfig(),
    context_lengths: Sequence[int] = (2048, 4096, 8192),
    max_new_tokens: int = 32,
    timing_steps: int = 16,
    warmup_steps: int = 2,
    path: str = "user",
    fusion: str = DEFAULT_STRATEGY,
    progress: Callable[[str], None] = lambda message: None,
) -> dict:
    configs = {name: selector_config(name, budget, base) for name in selectors}
    results = {
        "budget": budget,
        "sinks": base.sinks,
        "window": base.window,
        "codebook": {"id": codebook.id, "size": codebook.size, **codebook.info} if codebook else None,
        "memory": aux_memory(engine, codebook, configs, examples or speed_examples),
    }
    if examples:
        results["quality"] = run_quality(engine, codebook, examples, configs, max_new_tokens, progress, path, fusion)
    if context_lengths:
        results["speed"] = run_speed(
            engine, codebook, speed_examples, configs, context_lengths, timing_steps, warmup_steps, progress
        )
    return results


def format_table(results: dict) -> str:
    lines = []
    quality = results.get("quality", {}).get("selectors", {})
    speed = results.get("speed", {}).get("context_lengths", {})
    memory = results["memory"]["selectors"]
    lengths = list(speed)
    names = list(memory)
    if speed:
        names = ["engine_dense", *names]
    width = max(12, *(len(name) for name in names))
    header = (
        f"{'selector':<{width}} {'recall':>6} {'mass_r':>6} {'kept':>6} {'F1 dense':>8} {'F1 gold':>7} {'aux %KV':>7}"
    )
    for length in lengths:
        header += f" {'ms@' + length:>8} {'x':>5}"
    if "quality" in results:
        q = results["quality"]
        lines.append(
            f"budget {results['budget']} (sinks {results['sinks']} + window {results['window']} included); "
            f"path {q.get('path')} {q.get('fusion') or ''}; {q['examples']} examples, "
            f"{q['prompt_tokens']:.0f} prompt tokens on average; dense F1 gold {q['dense_f1_gold']:.3f}"
        )
    lines.append(header)
    for name in names:
        row = quality.get(name, {})
        mem = memory.get(name)
        line = (
            f"{name:<{width}} {row.get('recall', float('nan')):>6.3f} {row.get('mass_recall', float('nan')):>6.3f} "
            f"{row.get('kept_mass', float('nan')):>6.3f} "
            f"{row.get('f1_dense', float('nan')):>8.3f} {row.get('f1_gold', float('nan')):>7.3f} "
            f"{(100 * mem['aux_fraction_of_kv_fp16']) if mem else 0.0:>7.2f}"
        )
        for length in lengths:
            cell = speed[length].get(name)
            line += f" {cell['ms_per_token']:>8.1f} {cell['speedup']:>5.2f}" if cell else f" {'':>8} {'':>5}"
        paths = {speed[length][name]["decode_path"] for length in lengths if name in speed[length]}
        lines.append(line + (f"  ({', '.join(sorted(paths))} step)" if paths else ""))
    return "\n".join(lines)
