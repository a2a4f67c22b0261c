"""`ragkv serve bench --target URL... --workload pasted`: passages in the prompt on both sides.

What a RAG application behind either server sends: the same streamed chat completion, its
passages pasted into the user message, nothing ingested. Per example, in order:

    ragkv full      ragkv with prompt_spans off, the passages in reverse order: its own
                    full prefill of a prompt of the same length (nothing of it cached)
    cold            the passages in the dataset's order, each server seeing them first
    shuffled        the same questions, the passages shuffled: ragkv finds them in its
                    store; a prefix cache finds the opening only
    N clients       fresh shuffles, N clients at once: requests/s

Every pass runs one server after the other, one client unless N is given, measured at the
client (TTFT to the first content chunk; `usage` of the last chunk for the cached share).
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable

from ragkv.bench.datasets import load_examples
from ragkv.bench.peer_bench import PeerBenchConfig, Work, _level, target_body, target_model


def _bodies(
    work: list[Work], model: str, config: PeerBenchConfig, order: Callable[[int, int], list[int]], **extra
) -> list:
    bodies = []
    for number, item in enumerate(work):
        passages = [item.passages[i] for i in order(number, len(item.passages))]
        body = target_body(Work(item.question, passages, []), model, config.max_tokens, config.shape)
        bodies.append({**body, "stream_options": {"include_usage": True}, **extra})
    return bodies


def _shuffled(seed: int) -> Callable[[int, int], list[int]]:
    def order(number: int, count: int) -> list[int]:
        indices = list(range(count))
        random.Random(seed * 100_003 + number).shuffle(indices)
        return indices

    return order


def run_pasted_bench(
    ragkv_url: str,
    targets: list[str],
    config: PeerBenchConfig,
    progress: Callable[[str], None],
    headers: dict | None = None,
    target_headers: dict | None = None,
) -> dict:
    headers, target_headers = headers or {}, target_headers or {}
    examples = load_examples(config.dataset, config.examples, config.passages)
    work = [Work(e.question, [p.strip() for p in e.passages], []) for e in examples]
    sides = {"ragkv": (ragkv_url, "ragkv", headers)}
    for index, url in enumerate(targets):
        sides[f"target{index + 1}"] = (url, target_model(url, target_headers), target_headers)
    warm_up = {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 2, "stream": True}
    for url, model, side_headers in sides.values():
        asyncio.run(_level(url, [{**warm_up, "model": model}], 1, 1, side_headers))

    def run(name: str, label: str, order, clients: int = 1, **extra) -> dict:
        url, model, side_headers = sides[name]
        bodies = _bodies(work, model, config, order, **extra)
        figures = asyncio.run(_level(url, bodies, clients, len(bodies), side_headers))
        progress(
            f"{label}, {name}: TTFT p50 {figures['ttft_p50_s']} s, {figures['requests_per_s']:.3f} req/s, "
            f"cached {figures['cached_share']}, {figures['errors']} errors"
        )
        return figures

    reverse = lambda number, count: list(range(count))[::-1]  # noqa: E731
    passes: dict[str, dict] = {"ragkv_full_prefill": run("ragkv", "full prefill", reverse, prompt_spans=False)}
    for label, order in (("cold", lambda n, c: list(range(c))), ("shuffled", _shuffled(1))):
        passes[label] = {name: run(name, label, order) for name in sides}
    levels = []
    for level, clients in enumerate(config.clients, start=2):
        if clients > 1:
            row = {name: run(name, f"{clients} clients", _shuffled(level), clients) for name in sides}
            levels.append({"clients": clients, **row})
    return {
        "workload": "pasted",
        "ragkv": ragkv_url,
        "targets": {name: {"url": url, "model": model} for name, (url, model, _) in sides.items() if name != "ragkv"},
        "examples": len(work),
        "passages": config.passages,
        "max_tokens": config.max_tokens,
        "passes": passes,
        "levels": levels,
        "ratios": _ratios(passes, levels, sides),
    }


def _ratios(passes: dict, levels: list[dict], sides: dict) -> dict:
    """TTFT p50 of each target over ragkv's (how many times sooner ragkv answers), per pass;
    ragkv's cold pass over its own full prefill; requests/s of ragkv over each target."""
    ratios: dict[str, float | None] = {}
    full = passes["ragkv_full_prefill"]["ttft_p50_s"]
    ratios["cold_over_own_full_prefill"] = round(passes["cold"]["ragkv"]["ttft_p50_s"] / full, 3) if full else None
    for name in sides:
        if name == "ragkv":
            continue
        for label in ("cold", "shuffled"):
            ours, theirs = passes[label]["ragkv"]["ttft_p50_s"], passes[label][name]["ttft_p50_s"]
            ratios[f"{label}_ttft_{name}_over_ragkv"] = round(theirs / ours, 2) if ours and theirs else None
        for row in levels:
            ours, theirs = row["ragkv"]["requests_per_s"], row[name]["requests_per_s"]
            ratios[f"requests_per_s_{row['clients']}_clients_ragkv_over_{name}"] = (
                round(ours / theirs, 2) if theirs else None
            )
    return ratios
