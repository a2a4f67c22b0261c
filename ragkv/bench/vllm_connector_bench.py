"""`ragkv bench vllm-connector`: vLLM with RagkvConnector against vLLM alone, one server.

One vLLM server runs with the connector over a fresh store; a request that sends
`kv_transfer_params: {"ragkv": "off"}` is served by vLLM alone (the connector provides
nothing and saves nothing), so both sides run on the same machine, weights and process.
vLLM's own prefix cache is reset before every request. Per example, in order:

    seen        the passages in the dataset's order: vLLM computes the prompt; the
                connector stores its passage spans and the whole prompt (--seen alone:
                instead each passage in a prompt of its own, and no repeat below)
    full        the passages shuffled, vLLM alone: the reference (TTFT, first-token
                logprobs, greedy answer)
    fused       the same shuffled prompt: the connector fuses the stored spans on ragkv's
                engine and writes every row but the last into vLLM's cache
    repeat      the first prompt again: the connector loads vLLM's own stored rows; the
                greedy answer must be `seen`'s token for token

First-token KL(full || fused) is computed over the full side's top-`logprobs` tokens (vLLM
returns at most that many); a token missing from the fused side's list takes that list's
lowest log-probability (so the figure is a lower bound; `covered` is the full side's mass
the list holds). Teacher forcing is not available through vLLM's API with a connector: vLLM
computes no logits for the prompt positions the connector provides, so agreement is
reported free-running (the greedy answers' common prefix).
"""

from __future__ import annotations

import json
import math
import os
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx

from ragkv.bench.datasets import load_examples
from ragkv.bench.vllm_server import VllmServer

SYSTEM = "Answer the question using the documents given."


@dataclass(frozen=True)
class ConnectorBenchConfig:
    python: Path
    model: Path
    dataset: Path
    examples: tuple[int, int] = (50, 58)
    passages: int = 10
    max_tokens: int = 32
    logprobs: int = 100
    strategies: tuple[str, ...] = ("probe",)
    """Fusion strategies measured, each on its own request (kv_transfer_params ragkv_strategy)."""
    seed: int = 0
    seen: str = "prompt"
    """How the passages were seen before: "prompt" (the whole prompt in the dataset's order,
    computed by vLLM: its spans carry that context; then the repeated-prompt check) or
    "alone" (each passage in a prompt of its own with the question, as ingestion sees a
    chunk without its neighbours; no repeated-prompt check)."""


def prompt_ids(tokenizer, passages: list[str], question: str) -> list[int]:
    """The chat prompt a RAG application sends (as ragkv's pasted-passage benchmarks)."""
    documents = "\n\n".join(p.strip() for p in passages)
    messages = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": f"Documents:\n{documents}\n\nQuestion: {question}"},
    ]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    return list(ids)


def complete(
    url: str,
    ids: list[int],
    max_tokens: int,
    logprobs: int,
    kv_transfer_params: dict | None = None,
    model: str = "model",
) -> dict:
    """One streamed greedy completion: TTFT at the client, token ids, first-token top logprobs."""
    body = {
        "model": model,
        "prompt": ids,
        "max_tokens": max_tokens,
        "temperature": 0,
        "logprobs": logprobs,
        "stream": True,
        "return_tokens_as_token_ids": True,
    }
    if kv_transfer_params:
        body["kv_transfer_params"] = kv_transfer_params
    started = time.perf_counter()
    ttft, tokens, first, request_id = None, [], None, None
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=1800) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            request_id = request_id or chunk.get("id")
            for choice in chunk.get("choices", []):
                logprobs_part = choice.get("logprobs") or {}
                for index, token in enumerate(logprobs_part.get("tokens") or []):
                    if ttft is None:
                        ttft = time.perf_counter() - started
                    tokens.append(int(token.removeprefix("token_id:")))
                    if first is None:
                        top = (logprobs_part.get("top_logprobs") or [None])[index] or {}
                        first = {int(k.removeprefix("token_id:")): v for k, v in top.items()}
    return {
        "ttft": ttft,
        "tokens": tokens,
        "first": first or {},
        "id": request_id,
        "total": time.perf_counter() - started,
    }


def first_token_kl(full: dict[int, float], fused: dict[int, float]) -> tuple[float, float]:
    """KL(full || fused) over full's listed tokens, and the mass of full those hold."""
    floor = min(fused.values()) if fused else -math.inf
    kl, covered = 0.0, 0.0
    for token, logp in full.items():
        p = math.exp(logp)
        covered += p
        kl += p * (logp - fused.get(token, floor))
    return kl, covered


def common_prefix(a: list[int], b: list[int]) -> int:
    count = 0
    for x, y in zip(a, b):
        if x != y:
            break
        count += 1
    return count


def _connector_line(log: str, request_id: str | None, what: str) -> str | None:
    """The connector's log line about a request (vLLM suffixes the response id)."""
    if not request_id:
        return None
    for line in log.splitlines():
        if request_id in line and what in line:
            return line.split("] ", 1)[-1]
    return None


def run_connector_bench(config: ConnectorBenchConfig, work_dir: Path, progress: Callable[[str], None]) -> dict:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(config.model)
    start, end = config.examples
    examples = load_examples(config.dataset, end, config.passages)[start:end]
    connector = {"store_url": f"lmdb://{work_dir / 'store'}", "strategy": config.strategies[0]}
    server = VllmServer(
        config.python,
        config.model,
        work_dir / "vllm.log",
        connector=connector,
        extra_args=("--max-logprobs", str(config.logprobs)),
    )
    rows = []
    started = time.perf_counter()
    with server:
        progress(f"vLLM + RagkvConnector up in {time.perf_counter() - started:.0f} s at {server.url}")
        warm = prompt_ids(tokenizer, ["Hello."], "Hi?")
        complete(server.url, warm, 2, 1, {"ragkv": "off"})
        for number, example in enumerate(examples, start=start):
            order = list(range(len(example.passages)))
            random.Random(config.seed * 100_003 + number).shuffle(order)
            seen_ids = prompt_ids(tokenizer, example.passages, example.question)
            shuffled_ids = prompt_ids(tokenizer, [example.passages[i] for i in order], example.question)
            results = {}
            if config.seen == "alone":
                passes = [
                    (f"alone {i}", prompt_ids(tokenizer, [p], example.question), None)
                    for i, p in enumerate(example.passages)
                ]
            else:
                passes = [("seen", seen_ids, None)]
            passes += [("full", shuffled_ids, {"ragkv": "off"})]
            passes += [(f"fused {s}", shuffled_ids, {"ragkv_strategy": s}) for s in config.strategies]
            if config.seen != "alone":
                passes += [("repeat", seen_ids, None)]
            for name, ids, params in passes:
                server.reset_prefix_cache()
                results[name] = complete(server.url, ids, config.max_tokens, config.logprobs, params)
            log = server.log_text()
            full = results["full"]
            row = {
                "example": number,
                "prompt_tokens": len(shuffled_ids),
                "load_average_1m": os.getloadavg()[0],
                "ttft_full_s": full["ttft"],
                "answer_tokens": len(full["tokens"]),
                "strategies": {},
            }
            if "repeat" in results:
                seen, repeat = results["seen"], results["repeat"]
                row.update(
                    ttft_seen_s=seen["ttft"],
                    ttft_repeat_s=repeat["ttft"],
                    repeat_speedup=seen["ttft"] / repeat["ttft"],
                    repeat_identical=repeat["tokens"] == seen["tokens"],
                    connector_repeat=_connector_line(log, repeat["id"], "prefix wrote"),
                    connector_saved=_connector_line(log, seen["id"], "saved"),
                )
            for strategy in config.strategies:
                fused = results[f"fused {strategy}"]
                kl, covered = first_token_kl(full["first"], fused["first"])
                row["strategies"][strategy] = {
                    "ttft_fused_s": fused["ttft"],
                    "speedup": full["ttft"] / fused["ttft"],
                    "first_token_kl": kl,
                    "kl_covered_mass": covered,
                    "first_token_equal": _top(full["first"]) == _top(fused["first"]),
                    "answer_common_prefix": common_prefix(full["tokens"], fused["tokens"]),
                    "answer_identical": full["tokens"] == fused["tokens"],
                    "connector": _connector_line(log, fused["id"], "fuse wrote"),
                }
            rows.append(row)
            fused_text = ", ".join(
                f"{s} {r['ttft_fused_s']:.2f} s ({r['speedup']:.1f}x, KL {r['first_token_kl']:.4f})"
                for s, r in row["strategies"].items()
            )
            repeat_text = (
                f"repeat identical {row['repeat_identical']} ({row['ttft_repeat_s']:.2f} s), "
                if "repeat" in results
                else ""
            )
            progress(
                f"example {number}: {row['prompt_tokens']} tokens, full {row['ttft_full_s']:.2f} s, {fused_text}, "
                f"{repeat_text}load {row['load_average_1m']:.1f}"
            )
    return {
        "config": {k: str(v) for k, v in config.__dict__.items()},
        "rows": rows,
        "summary": summary(rows, config.strategies),
    }


def _top(logprobs: dict[int, float]) -> int | None:
    return max(logprobs, key=logprobs.get) if logprobs else None


def summary(rows: list[dict], strategies: tuple[str, ...]) -> dict:
    if not rows:
        return {}
    result = {
        "examples": len(rows),
        "prompt_tokens_median": statistics.median(r["prompt_tokens"] for r in rows),
        "ttft_full_median_s": statistics.median(r["ttft_full_s"] for r in rows),
        "load_average_1m_median": statistics.median(r["load_average_1m"] for r in rows),
        "strategies": {},
    }
    if all("repeat_identical" in r for r in rows):
        result["repeat_identical"] = sum(r["repeat_identical"] for r in rows)
        result["ttft_repeat_median_s"] = statistics.median(r["ttft_repeat_s"] for r in rows)
        result["ttft_seen_median_s"] = statistics.median(r["ttft_seen_s"] for r in rows)
    for strategy in strategies:
        per = [r["strategies"][strategy] for r in rows]
        result["strategies"][strategy] = {
            "ttft_fused_median_s": statistics.median(p["ttft_fused_s"] for p in per),
            "speedup_median": statistics.median(p["speedup"] for p in per),
            "speedup_of_totals": sum(r["ttft_full_s"] for r in rows) / sum(p["ttft_fused_s"] for p in per),
            "first_token_kl_mean": statistics.fmean(p["first_token_kl"] for p in per),
            "first_token_kl_median": statistics.median(p["first_token_kl"] for p in per),
            "first_token_equal": sum(p["first_token_equal"] for p in per),
            "answer_identical": sum(p["answer_identical"] for p in per),
            "answer_common_prefix_mean": statistics.fmean(p["answer_common_prefix"] for p in per),
        }
    return result
