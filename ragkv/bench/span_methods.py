"""`ragkv bench passages --methods`: how much of what a second prompt could reuse each way
of finding passages finds, with the tokenizer alone (no weights): the prompt pairs of the
shapes bench (ragkv.bench.shapes_bench.pair_for), the first prompt's spans taken as what
the store holds.

    spans          a span of the second prompt is served when a span of the first holds
                   the same tokens (whole-span keys: the product before anchors)
    rolling_hash   the same with content-defined cuts over the whole prompt, blank lines
                   and markup ignored (the alternative to blocks)
    anchors        the product: whole spans, plus the stretches the anchors of the second
                   prompt find inside the first prompt's spans (lookup.py's rounds, the
                   store replaced by a dict of the same keys)

Each is the share of the second prompt's reusable tokens (shapes_bench.reusable_mask)
that it serves.
"""

from __future__ import annotations

import random
from collections.abc import Callable

import numpy as np

from ragkv.app.chat.conversation import render_conversation
from ragkv.app.passages.anchors import AnchorConfig, anchor_positions, extend
from ragkv.app.passages.finder import Span, SpanConfig, SpanFinder
from ragkv.bench.datasets import Example
from ragkv.bench.prompt_shapes import SHAPES
from ragkv.bench.shapes_bench import SPLITTER, pair_for, reusable_mask

METHODS = ("spans", "rolling_hash", "anchors")


def run_span_methods(prompt, tokenizer, examples: list[Example], seed: int = 0) -> dict:
    """Per shape and method: the share of the second prompts' reusable tokens served."""
    if len(examples) < 2:
        raise ValueError("--methods needs at least two examples (the next one brings the new passages)")
    finder = SpanFinder(tokenizer)
    rolling = SpanFinder(tokenizer, SpanConfig(max_tokens=256, cut_bits=6))
    finders: dict[str, Callable[[list[int]], list[Span]]] = {
        "spans": finder.spans,
        "rolling_hash": lambda ids: rolling_hash_spans(rolling, ids),
    }
    anchors = AnchorConfig()
    results: dict[str, dict[str, float]] = {}
    for shape in [*SHAPES, SPLITTER]:
        rng = random.Random(seed)
        served = dict.fromkeys(METHODS, 0)
        reusable_tokens = 0
        for number, example in enumerate(examples[:-1]):
            pair = pair_for(shape, example, examples[number + 1], rng)
            first = render_conversation(prompt, pair.first).token_ids
            second = render_conversation(prompt, pair.second).token_ids
            reusable = reusable_mask(first, second, [prompt.encode(text) for text in pair.texts])
            reusable_tokens += int(reusable.sum())
            for method, find in finders.items():
                served[method] += int((_exact(find, first, second) & reusable).sum())
            served["anchors"] += int((_anchored(finder.spans, anchors, first, second) & reusable).sum())
        results[shape] = {m: round(served[m] / max(1, reusable_tokens), 4) for m in METHODS}
    return results


def rolling_hash_spans(finder: SpanFinder, ids: list[int]) -> list[Span]:
    """Content-defined cuts by a rolling hash over the whole prompt, blank lines ignored
    (the last `min_tokens` left out)."""
    array = np.asarray(ids, dtype=np.int64)
    return [Span(a, b) for a, b in finder._cut(array, 0, len(ids)) if b - a >= finder.config.min_tokens][:-1]


def _exact(find, first: list[int], second: list[int]) -> np.ndarray:
    stored = {tuple(first[s.start : s.end]) for s in find(first)}
    mask = np.zeros(len(second), dtype=bool)
    for span in find(second):
        if tuple(second[span.start : span.end]) in stored:
            mask[span.start : span.end] = True
    return mask


def _anchored(find, config: AnchorConfig, first: list[int], second: list[int]) -> np.ndarray:
    """Whole spans, then what the anchors find: every anchor window of a stored run keyed
    by its tokens (the store's anchor records), each anchor of the second prompt extended
    along its run."""
    mask = _exact(find, first, second)
    runs = [np.asarray(first[s.start : s.end], dtype=np.int64) for s in find(first)]
    records: dict[tuple[int, ...], tuple[int, int]] = {}
    for number, run in enumerate(runs):
        for p in anchor_positions(run, config).tolist():
            records[tuple(run[p - config.window + 1 : p + 1].tolist())] = (number, p)
    ids = np.asarray(second, dtype=np.int64)
    low, high = 1, len(second) - 1
    for p in (anchor_positions(ids[low:high], config) + low).tolist():
        record = records.get(tuple(second[p - config.window + 1 : p + 1]))
        if record is None or mask[p]:
            continue
        start, end = extend(ids, p, runs[record[0]], record[1], low, high)
        if end - start >= config.min_match:
            mask[start:end] = True
    return mask
