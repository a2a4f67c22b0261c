"""`ragkv serve bench`: the API measured over loopback HTTP, and the batched decode step.

1. Chat sessions: TTFT of turn 1 (retrieve + load + fuse) vs turn 2 (the session's KV
   reused, only the previous answer and the new message computed), server-side (request
   arrival to the first token) and client-side (request sent -> first content chunk).
2. /v1/query under load: a bounded loop of N requests with 1, 4, 8 concurrent clients;
   requests/s, p50/p99 latency (request sent -> whole answer received), p50/p99 TTFT
   (server: arrival -> first token), and completion tokens/s over the level's wall time.
3. Decode: B requests decoding together through the scheduler (one batched forward pass
   per step; EOS ignored so B stay active), in this process: aggregate tokens/s per B.

Without --url it starts `ragkv serve` on a free port over a scratch data folder (or
--data-dir), ingests the example corpus through the API first, and stops it at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import numpy as np

QUESTIONS = [
    "When was Gull Point Light first lit?",
    "Who founded Hallerberg Observatory, and when?",
    "Which apple variety is planted most at Linden Hill Orchard?",
    "How tall is Stormhead Light?",
    "How often does comet Weiss-Hallerberg return?",
    "How much juice does the orchard press each year?",
]
FOLLOW_UPS = ["Can you say that more briefly?", "What else does the text say about it?", "Why does that matter?"]


def default_corpus() -> Path:
    return Path(__file__).resolve().parents[2] / "examples" / "corpus"


def _percentile(values: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(values), q)) if values else float("nan")


def _ingest(http: httpx.Client, corpus: Path, progress: Callable[[str], None]) -> None:
    for path in sorted(p for p in corpus.iterdir() if p.is_file()):
        response = http.post("/v1/documents", json={"text": path.read_text(), "name": path.name, "background": False})
        response.raise_for_status()
        ingest = response.json()["ingest"]
        progress(f"ingested {path.name}: {ingest['chunks']} chunk(s), {ingest['computed_chunks']} computed")


def _chat_turn(http: httpx.Client, message: str, session_id: str | None, max_tokens: int) -> dict:
    body = {
        "model": "ragkv",
        "max_tokens": max_tokens,
        "stream": True,
        "messages": [{"role": "user", "content": message}],
    }
    if session_id:
        body["session_id"] = session_id
    started = time.perf_counter()
    first_token = None
    final = None
    with http.stream("POST", "/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(chunk["error"]["message"])
            choice = chunk["choices"][0] if chunk.get("choices") else {}
            if first_token is None and choice.get("delta", {}).get("content"):
                first_token = time.perf_counter() - started
            if choice.get("finish_reason"):
                final = chunk
    return {
        "session_id": final["session_id"],
        "server_ttft_s": final["rag"]["timings"]["ttft"],
        "client_ttft_s": first_token,
        "prompt_tokens": final["rag"]["session"]["tokens"],
    }


def bench_chat(http: httpx.Client, sessions: int, max_tokens: int, progress: Callable[[str], None]) -> dict:
    turns: dict[str, list[dict]] = {"turn_1": [], "turn_2": []}
    for index in range(sessions):
        first = _chat_turn(http, QUESTIONS[index % len(QUESTIONS)], None, max_tokens)
        second = _chat_turn(http, FOLLOW_UPS[index % len(FOLLOW_UPS)], first["session_id"], max_tokens)
        turns["turn_1"].append(first)
        turns["turn_2"].append(second)
        progress(
            f"session {index + 1}: TTFT turn 1 {first['server_ttft_s']:.3f} s, turn 2 {second['server_ttft_s']:.3f} s"
        )
    out = {}
    for name, rows in turns.items():
        out[name] = {
            "server_ttft_s_median": round(statistics.median(r["server_ttft_s"] for r in rows), 4),
            "client_ttft_s_median": round(statistics.median(r["client_ttft_s"] or float("nan") for r in rows), 4),
            "prompt_tokens_median": statistics.median(r["prompt_tokens"] for r in rows),
        }
    out["turn_2_over_turn_1"] = round(out["turn_2"]["server_ttft_s_median"] / out["turn_1"]["server_ttft_s_median"], 3)
    out["sessions"] = sessions
    return out


async def _load_level(base_url: str, headers: dict, clients: int, requests: int, max_tokens: int) -> dict:
    latencies: list[float] = []
    server_ttft: list[float] = []
    queue: list[float] = []
    completion_tokens = 0
    errors = 0
    counter = iter(range(requests))

    async with httpx.AsyncClient(
        base_url=base_url, headers=headers, timeout=600, limits=httpx.Limits(max_connections=clients + 4)
    ) as http:

        async def client_loop() -> None:
            nonlocal errors, completion_tokens
            for index in counter:
                body = {"question": QUESTIONS[index % len(QUESTIONS)], "max_tokens": max_tokens}
                started = time.perf_counter()
                response = await http.post("/v1/query", json=body)
                elapsed = time.perf_counter() - started
                if response.status_code != 200:
                    errors += 1
                    continue
                latencies.append(elapsed)
                completion_tokens += response.json()["usage"]["completion_tokens"]
                timings = response.json()["timings"]
                server_ttft.append(timings["ttft"])
                queue.append(timings["queue"])

        started = time.perf_counter()
        await asyncio.gather(*(client_loop() for _ in range(clients)))
        wall = time.perf_counter() - started
    return {
        "clients": clients,
        "requests": requests,
        "errors": errors,
        "wall_s": round(wall, 3),
        "requests_per_s": round(len(latencies) / wall, 3),
        "latency_p50_s": round(_percentile(latencies, 50), 3),
        "latency_p99_s": round(_percentile(latencies, 99), 3),
        "latency_mean_s": round(statistics.fmean(latencies), 3) if latencies else None,
        "ttft_p50_s": round(_percentile(server_ttft, 50), 3),
        "ttft_p99_s": round(_percentile(server_ttft, 99), 3),
        "completion_tokens_per_s": round(completion_tokens / wall, 2),
        "queue_wait_mean_s": round(statistics.fmean(queue), 3) if queue else None,
    }


def bench_load(
    base_url: str,
    headers: dict,
    levels: list[int],
    requests: int | None,
    max_tokens: int,
    progress: Callable[[str], None],
) -> list[dict]:
    rows = []
    for clients in levels:
        count = requests or max(16, 2 * clients)
        row = asyncio.run(_load_level(base_url, headers, clients, count, max_tokens))
        progress(
            f"{clients:>3} clients: {row['requests_per_s']:.2f} req/s, latency p50 {row['latency_p50_s']:.2f} s "
            f"p99 {row['latency_p99_s']:.2f} s, TTFT p50 {row['ttft_p50_s']:.2f} s p99 {row['ttft_p99_s']:.2f} s "
            f"({count} requests, {row['errors']} errors)"
        )
        rows.append(row)
    return rows


def bench_decode(batches: list[int], prompt_tokens: int, steps: int, progress: Callable[[str], None]) -> list[dict]:
    """Aggregate decode tokens/s with B requests in the scheduler's batched decode step."""
    import torch

    from ragkv.app.generate import CollectingSink
    from ragkv.app.request import Prepared, Request
    from ragkv.app.scheduler import Scheduler, SchedulerConfig
    from ragkv.app.usage import TokenUsage
    from ragkv.engine import Engine
    from ragkv.engine.generation import GenerationConfig

    engine = Engine()
    generator = torch.Generator().manual_seed(0)
    rows = []
    for batch in batches:
        scheduler = Scheduler(engine.model, engine.tokenizer, set(), SchedulerConfig(max_running=batch))
        for _ in range(batch):
            ids = torch.randint(100, 20000, (prompt_tokens,), generator=generator).tolist()

            def prepare(request: Request, ids=ids) -> Prepared:
                cache, logits = engine.prefill(ids, steps + 1)
                return Prepared(cache, logits, TokenUsage(prompt_tokens=len(ids)), "none")

            scheduler.add(Request("bench", prepare, GenerationConfig(max_new_tokens=steps + 1), CollectingSink()))
        while len(scheduler.running) < batch:
            scheduler.step()
        started = time.perf_counter()
        decoded = 0
        while len(scheduler.running) == batch:
            scheduler.step()
            decoded += batch
        seconds = time.perf_counter() - started
        scheduler.run_until_done()
        rows.append(
            {
                "batch": batch,
                "prompt_tokens": prompt_tokens,
                "tokens": decoded,
                "seconds": round(seconds, 3),
                "tokens_per_s": round(decoded / seconds, 2),
            }
        )
        progress(f"decode batch {batch:>2}: {decoded / seconds:.1f} tokens/s ({prompt_tokens}-token prompts)")
    base = rows[0]["tokens_per_s"]
    for row in rows:
        row["vs_first"] = round(row["tokens_per_s"] / base, 2)
    return rows


def run_serve_bench(args: argparse.Namespace, progress: Callable[[str], None] = print) -> dict:
    from ragkv.api.launcher import ServerProcess

    headers = {"Authorization": f"Bearer {args.bench_key}"} if args.bench_key else {}
    server = None
    scratch = None
    base_url = args.url
    if base_url is None:
        if args.data_dir is None:
            scratch = tempfile.TemporaryDirectory(prefix="ragkv-serve-bench-")
        data_dir = str(args.data_dir or scratch.name)
        serve_args = ["--data-dir", data_dir, "--max-queued", str(max(64, 2 * max(args.clients)))]
        if args.store:
            serve_args += ["--store", args.store]
        if args.api_keys_file:
            serve_args += ["--api-keys", str(args.api_keys_file)]
        progress(f"starting ragkv serve over {data_dir} ...")
        server = ServerProcess(serve_args).start()
        base_url = server.url
    try:
        with httpx.Client(base_url=base_url, headers=headers, timeout=600) as http:
            health = http.get("/health").json()
            _ingest(http, args.corpus or default_corpus(), progress)
            http.post("/v1/query", json={"question": QUESTIONS[0], "max_tokens": 2}).raise_for_status()  # warm-up
            chat = bench_chat(http, args.sessions, args.max_tokens, progress) if args.sessions else None
        load = bench_load(base_url, headers, args.clients, args.requests, args.max_tokens, progress)
    finally:
        if server is not None:
            server.stop()
        if scratch is not None:
            scratch.cleanup()
    decode = bench_decode(args.decode_batches, args.decode_prompt_tokens, args.max_tokens, progress)
    single = load[0]["requests_per_s"] if load else None
    for row in load:
        row["vs_first"] = round(row["requests_per_s"] / single, 2) if single else None
    return {
        "server": base_url,
        "model": health.get("model"),
        "max_tokens": args.max_tokens,
        "chat": chat,
        "query_load": load,
        "decode": decode,
    }
