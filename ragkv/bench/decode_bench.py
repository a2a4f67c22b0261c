"""Dense decode speed and quality per numerics option (`ragkv bench decode`).

Speed: ms/token (median of greedy steps) at several context lengths, the bytes a step
reads (decode weights + KV rows) and the bandwidth that implies; batched decode tokens/s.
Timing caches hold random rows: a step's work does not depend on the values, and a 8K
prefill per option would cost minutes. Quality, per dev example: the last prompt token
goes through `decode_step` (so the decode weights produce it) after a prefill of the rest;
KL(float32 reference || option) of those first-token logits, and whether the greedy answer
matches the reference's token for token.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

import torch

from ragkv.bench.datasets import Example
from ragkv.engine.kv_cache import KVCache
from ragkv.engine.model import CausalLM
from ragkv.engine.numerics import Numerics, resolve_numerics
from ragkv.fusion.fidelity import next_token_kl

REFERENCE = "float32"
OPTIONS: dict[str, Numerics] = {
    "auto": resolve_numerics("float32", "auto", "auto", "auto", "cpu"),
    "auto-int8": resolve_numerics("float32", "auto", "int8", "auto", "cpu"),
    "auto-int4": resolve_numerics("float32", "auto", "int4", "auto", "cpu"),
    "float32": Numerics("float32", "float32", "float32", "float32"),
    "bfloat16": Numerics("bfloat16", "bfloat16", "bfloat16", "bfloat16"),
    "bf16-weights": Numerics("float32", "bfloat16", "bfloat16", "bfloat16"),
    "int8": Numerics("float32", "float32", "int8", "bfloat16"),
    "int8-f32kv": Numerics("float32", "float32", "int8", "float32"),
    "int4-f32kv": Numerics("float32", "float32", "int4", "float32"),
    "int8-bf16kv": Numerics("float32", "bfloat16", "int8", "bfloat16"),
    "int4-bf16kv": Numerics("float32", "bfloat16", "int4", "bfloat16"),
}
"""Named numerics (residual dtype, KV cache dtype, decode weights, prefill weights); "auto"
is what the engine picks on this machine, "auto-int8"/"auto-int4" the same with those
decode weights."""

PYTHON_LOOP = "+python"
"""Suffix of an option that decodes through the Python forward loop even where the compiled
decode step applies (its reference, and what it is measured against)."""


def option_names() -> list[str]:
    return [*OPTIONS, *(name + PYTHON_LOOP for name in OPTIONS)]


def _numerics_of(option: str) -> Numerics:
    return OPTIONS[option.removesuffix(PYTHON_LOOP)]


@dataclass(frozen=True)
class SpeedRow:
    option: str
    context: int
    ms_per_token: float
    bytes_per_step: int
    gb_per_s: float


@dataclass(frozen=True)
class WindowRow:
    """Decode of a model with sliding-window layers, its cache letting those layers release
    rows their window no longer reaches (CausalLM.decode_batch) or keeping every row."""

    option: str
    context: int
    ms_per_token: float
    """With the windowed layers' rows released (the untrimmed figure is the speed row's)."""
    kv_bytes_per_token_full_layers: int
    """KV bytes a token of context costs when every layer keeps every row."""
    kv_bytes_per_token_trimmed: int
    """What a further token costs once past the window: the full-attention layers' rows only."""
    kv_bytes_held_at_context: int
    """KV bytes of the rows held after the timed steps, windowed layers trimmed."""
    kv_bytes_held_at_context_untrimmed: int


@dataclass(frozen=True)
class BatchRow:
    option: str
    batch: int
    context: int
    tokens_per_s: float


@dataclass(frozen=True)
class QualityRow:
    option: str
    examples: int
    prompt_tokens: float
    first_token_kl_mean: float
    first_token_kl_max: float
    first_token_top1_agreement: float
    answer_agreement: float
    """Share of examples whose greedy answer equals the reference's token for token."""


@dataclass
class DecodeBenchResult:
    threads: int
    steps: int
    numerics: dict[str, dict[str, str]]
    speed: list[SpeedRow] = field(default_factory=list)
    batch: list[BatchRow] = field(default_factory=list)
    window: list[WindowRow] = field(default_factory=list)
    quality: list[QualityRow] = field(default_factory=list)
    note: str = ""

    def to_json(self) -> dict:
        return asdict(self)


def decode_weight_bytes(model: CausalLM) -> int:
    """Bytes of the kernels a decode step reads (the few-rows kernel of every Linear)."""
    linears = [model.weights.lm_head]
    for layer in model.weights.layers:
        linears += [layer.qkv, layer.o_proj, layer.gate_up, layer.down]
    return sum(
        tensor.nbytes
        for linear in linears
        for tensor in vars(linear.few_rows).values()
        if isinstance(tensor, torch.Tensor)
    )


def kv_bytes(model: CausalLM, rows: int) -> int:
    spec = model.spec
    return 2 * spec.num_layers * spec.num_kv_heads * rows * spec.head_dim * model.dtype.itemsize


def kv_bytes_held(model: CausalLM, cache: KVCache) -> int:
    """Bytes of the K and V rows `cache` holds (released rows of windowed layers not counted)."""
    spec = model.spec
    row = 2 * spec.num_kv_heads * spec.head_dim * model.dtype.itemsize
    return row * sum(cache.length - cache.first_row(layer) for layer in range(spec.num_layers))


def random_cache(model: CausalLM, rows: int, extra: int, seed: int = 0) -> KVCache:
    cache = model.new_cache(rows + extra)
    generator = torch.Generator().manual_seed(seed)
    for buffer in (cache.keys, cache.values):
        buffer[:, :, :rows] = torch.randn(buffer[:, :, :rows].shape, generator=generator).to(buffer.dtype)
    cache.length = cache.next_position = rows
    return cache


@torch.inference_mode()
def time_decode(
    model: CausalLM,
    context: int,
    steps: int,
    warmup: int = 3,
    release_window_rows: bool = False,
    held: list | None = None,
) -> float:
    """Median seconds of one greedy decode step at `context` cached rows; `held` gets the
    KV bytes the cache holds after the last step."""
    cache = random_cache(model, context, steps + warmup)
    token, times = 5, []
    for step in range(steps + warmup):
        started = time.perf_counter()
        token = int(model.decode_step(token, cache, release_window_rows=release_window_rows).argmax())
        if step >= warmup:
            times.append(time.perf_counter() - started)
    if held is not None:
        held.append(kv_bytes_held(model, cache))
    return statistics.median(times)


@torch.inference_mode()
def time_batch(model: CausalLM, batch: int, context: int, steps: int, warmup: int = 2) -> float:
    """Tokens per second of `batch` requests decoding together, each at `context` rows."""
    caches = [random_cache(model, context, steps + warmup, seed) for seed in range(batch)]
    tokens = [5] * batch
    times = []
    for step in range(steps + warmup):
        started = time.perf_counter()
        tokens = model.decode_batch(tokens, caches).argmax(-1).tolist()
        if step >= warmup:
            times.append(time.perf_counter() - started)
    return batch / statistics.median(times)


@torch.inference_mode()
def first_token_and_answer(model: CausalLM, ids: list[int], max_new_tokens: int) -> tuple[torch.Tensor, list[int]]:
    """Logits of the last prompt token through decode_step, and the greedy answer ids."""
    cache = model.new_cache(len(ids) + max_new_tokens)
    if len(ids) > 1:
        model.prefill(torch.tensor(ids[:-1]), cache)
    first = model.decode_step(ids[-1], cache).float()
    answer, logits = [], first
    for _ in range(max_new_tokens):
        answer.append(int(logits.argmax()))
        logits = model.decode_step(answer[-1], cache)
    return first, answer


def run_decode_bench(
    load: Callable[[Numerics], CausalLM],
    prompts: Sequence[list[int]],
    *,
    options: Sequence[str],
    contexts: Sequence[int],
    batches: Sequence[int],
    batch_context: int,
    steps: int,
    max_new_tokens: int,
    progress: Callable[[str], None] = lambda message: None,
) -> DecodeBenchResult:
    unknown = [name for name in options if name not in option_names()]
    if unknown:
        raise ValueError(f"unknown options {unknown}; known: {option_names()}")
    result = DecodeBenchResult(
        threads=torch.get_num_threads(), steps=steps, numerics={name: asdict(_numerics_of(name)) for name in options}
    )
    reference: list[tuple[torch.Tensor, list[int]]] = []
    if prompts:
        progress("quality: float32 reference")
        model = load(OPTIONS[REFERENCE])
        reference = [first_token_and_answer(model, ids, max_new_tokens) for ids in prompts]
        del model
    for name in options:
        progress(f"{name}: loading")
        model = load(_numerics_of(name))
        model.compiled_decode = not name.endswith(PYTHON_LOOP)
        weight_bytes = decode_weight_bytes(model)
        for context in contexts:
            progress(f"{name}: decode at {context}")
            untrimmed: list[int] = []
            seconds = time_decode(model, context, steps, held=untrimmed)
            moved = weight_bytes + kv_bytes(model, context)
            result.speed.append(SpeedRow(name, context, 1e3 * seconds, moved, moved / seconds / 1e9))
            if model.spec.sliding_layers:
                progress(f"{name}: decode at {context}, windowed layers releasing rows")
                trimmed: list[int] = []
                seconds = time_decode(model, context, steps, release_window_rows=True, held=trimmed)
                full_layers = model.spec.num_layers - len(model.spec.sliding_layers)
                result.window.append(
                    WindowRow(
                        name,
                        context,
                        1e3 * seconds,
                        kv_bytes(model, 1),
                        kv_bytes(model, 1) * full_layers // model.spec.num_layers,
                        trimmed[0],
                        untrimmed[0],
                    )
                )
        for batch in batches:
            progress(f"{name}: batch {batch}")
            result.batch.append(BatchRow(name, batch, batch_context, time_batch(model, batch, batch_context, steps)))
        if prompts:
            progress(f"{name}: quality on {len(prompts)} examples")
            kls, top1, same = [], [], []
            for ids, (expected_first, expected_answer) in zip(prompts, reference):
                first, answer = first_token_and_answer(model, ids, max_new_tokens)
                kls.append(next_token_kl(expected_first, first))
                top1.append(float(first.argmax() == expected_first.argmax()))
                same.append(float(answer == expected_answer))
            result.quality.append(
                QualityRow(
                    name,
                    len(prompts),
                    statistics.fmean(len(ids) for ids in prompts),
                    statistics.fmean(kls),
                    max(kls),
                    statistics.fmean(top1),
                    statistics.fmean(same),
                )
            )
        del model
    return result


def rag_prompts(
    tokenize: Callable[[str], list[int]], segments: Callable, examples: Sequence[Example]
) -> list[list[int]]:
    """[prefix | passages | question] token ids of each example (the plain-prefill prompt)."""
    prompts = []
    for example in examples:
        parts = segments(example.question)
        document = [token for passage in example.passages for token in tokenize(passage)]
        prompts.append(parts.prefix_ids + document + parts.question_ids)
    return prompts


def format_table(result: DecodeBenchResult) -> str:
    lines = [f"threads {result.threads}, median of {result.steps} steps. {result.note}".strip(), ""]
    contexts = sorted({row.context for row in result.speed})
    lines.append("option              " + "".join(f"{f'ms@{c}':>10}{'GB/s':>7}" for c in contexts))
    for name in dict.fromkeys(row.option for row in result.speed):
        cells = {row.context: row for row in result.speed if row.option == name}
        lines.append(
            f"{name:<20}" + "".join(f"{cells[c].ms_per_token:>10.1f}{cells[c].gb_per_s:>7.1f}" for c in contexts)
        )
    if result.window:
        lines += ["", "sliding-window layers releasing rows in decode (KV bytes: K and V rows held)"]
        lines.append(
            "option              context   ms/token  bytes/token all  bytes/token past window  held      held untrimmed"
        )
        for row in result.window:
            lines.append(
                f"{row.option:<20}{row.context:>7}{row.ms_per_token:>11.1f}{row.kv_bytes_per_token_full_layers:>17}"
                f"{row.kv_bytes_per_token_trimmed:>25}{row.kv_bytes_held_at_context:>10}"
                f"{row.kv_bytes_held_at_context_untrimmed:>16}"
            )
    if result.batch:
        lines += ["", "batched decode, tokens/s (context " + str(result.batch[0].context) + " each)"]
        batches = sorted({row.batch for row in result.batch})
        lines.append("option              " + "".join(f"{f'B={b}':>9}" for b in batches))
        for name in dict.fromkeys(row.option for row in result.batch):
            cells = {row.batch: row for row in result.batch if row.option == name}
            lines.append(f"{name:<20}" + "".join(f"{cells[b].tokens_per_s:>9.1f}" for b in batches))
    if result.quality:
        lines += [
            "",
            "quality vs float32 (first token through decode_step)",
            "option               KL mean   KL max  top1  answer",
        ]
        for row in result.quality:
            lines.append(
                f"{row.option:<20}{row.first_token_kl_mean:>8.4f}{row.first_token_kl_max:>9.4f}"
                f"{row.first_token_top1_agreement:>6.2f}{row.answer_agreement:>8.2f}"
            )
    return "\n".join(lines)
