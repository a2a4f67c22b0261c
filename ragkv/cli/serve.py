"""`ragkv serve`: the HTTP API under uvicorn; `ragkv serve bench`: its load benchmark.

    ragkv serve [--host 127.0.0.1] [--port 8000] [--store URL] [--data-dir DIR] [--api-keys keys.json] ...
    ragkv serve bench [--url http://HOST:PORT] [--clients 1 4 8] [--requests 32] [--max-tokens 16] [--json out.json]
    ragkv serve followup [--url http://HOST:PORT] [--dataset musique_dev.json] [--max-tokens 16] [--json out.json]
    ragkv serve followup --replicas --dataset musique_dev.json   (turn 2 on the other of two replicas)
    ragkv serve followup --replicas --router [BIN] --clients 8 --turns 3 --dataset musique_dev.json
        (many clients' chats pinned to a replica, through vllm-router round_robin and cache_aware)
    ragkv serve bench --target http://127.0.0.1:8080 --dataset musique_dev.json   (ragkv beside another server)

Every ServeConfig field is an option (its docstring is the help).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ragkv.cli.command import Command
from ragkv.cli.config_args import add_config_options, config_from_args
from ragkv.cli.options import add_common_options, runtime_config


def configure(serve: argparse.ArgumentParser) -> None:
    from ragkv.api.config import ServeConfig
    from ragkv.ingest.pipeline import IngestConfig

    serve.add_argument(
        "action",
        nargs="?",
        choices=("bench", "followup"),
        default=None,
        help="bench: chat TTFT (turn 1 vs 2), /v1/query throughput/latency/TTFT and batched decode; "
        "followup: a follow-up turn sent by the openai client and LangChain as the whole history",
    )
    add_common_options(serve)
    add_config_options(serve.add_argument_group("server"), ServeConfig)
    add_config_options(serve.add_argument_group("ingestion"), IngestConfig, skip=("show_progress",))
    serve.add_argument(
        "--api-keys",
        type=Path,
        default=None,
        dest="api_keys_file",
        help='JSON file {"key": "tenant", ...}; also $RAGKV_API_KEYS="key:tenant,..." (default: no keys)',
    )
    serve.add_argument(
        "--log-level",
        default="info",
        choices=("critical", "error", "warning", "info", "debug"),
        help="level of the server's own logs (default: info); the access log has its own switch",
    )
    bench = serve.add_argument_group("bench (ragkv serve bench)")
    bench.add_argument("--url", default=None, help="benchmark this running server instead of starting one")
    bench.add_argument("--clients", type=int, nargs="+", default=[1, 4, 8], help="concurrency levels (default: 1 4 8)")
    bench.add_argument("--requests", type=int, default=None, help="requests per level (default: max(16, 2 x clients))")
    bench.add_argument("--max-tokens", type=int, default=16, help="max_tokens of each request (default: 16)")
    bench.add_argument(
        "--sessions", type=int, default=3, help="chat sessions for the turn-1 vs turn-2 TTFT (default: 3)"
    )
    bench.add_argument("--corpus", type=Path, default=None, help="documents to ingest first (default: examples/corpus)")
    bench.add_argument("--bench-key", default=None, help="API key the benchmark client sends")
    bench.add_argument(
        "--decode-batches",
        type=int,
        nargs="+",
        default=[1, 8],
        help="requests decoding together in the decode measurement (default: 1 8)",
    )
    bench.add_argument(
        "--decode-prompt-tokens",
        type=int,
        default=2048,
        help="prompt length of each request in the decode measurement (default: 2048)",
    )
    bench.add_argument(
        "--dataset",
        type=Path,
        default=None,
        help="followup (required): MuSiQue-style JSON (ctxs, question); a sample's passages form a document",
    )
    bench.add_argument(
        "--target",
        nargs="+",
        default=None,
        metavar="URL",
        help="bench: instead, the same RAG workload (--dataset questions with their passages) on ragkv and on "
        "these OpenAI-compatible servers (llama-server, vLLM), side by side",
    )
    bench.add_argument(
        "--workload",
        choices=("ingested", "pasted"),
        default="ingested",
        help="bench --target: ingested = ragkv has the passages as documents, the target gets them in the prompt "
        "(one target); pasted = both get them in the prompt: ragkv's full prefill, a cold pass, a pass with the "
        "passages shuffled, then each --clients level above 1 with fresh shuffles",
    )
    bench.add_argument(
        "--shape",
        default=None,
        help="bench --workload pasted: the prompt a real RAG app sends (ragkv.bench.prompt_shapes: blank_lines, "
        "open_webui, anythingllm, langchain_hub, llamaindex, json_lines); default: documents joined by blank lines "
        "in the user message",
    )
    bench.add_argument("--target-key", default=None, help="API key sent to --target")
    bench.add_argument("--passages", type=int, default=3, help="bench --target: passages per question (default: 3)")
    bench.add_argument(
        "--examples", type=int, default=16, help="bench --target: questions in the workload (default: 16)"
    )
    bench.add_argument(
        "--replicas",
        action="store_true",
        help="followup: start two replicas over one redis-server and send turn 2 to both (same replica vs other)",
    )
    bench.add_argument(
        "--router",
        nargs="?",
        const="",
        default=None,
        metavar="BIN",
        help="followup --replicas: instead, --clients chats of --turns turns at once, pinned to a replica, then "
        "through vllm-router round_robin and cache_aware (BIN, else vllm-router on PATH or the one "
        "scripts/install_router.sh installs)",
    )
    bench.add_argument("--turns", type=int, default=3, help="followup --replicas --router: turns per chat (default: 3)")
    bench.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="followup --replicas --router: the three fronts this many times, every other round in reverse order",
    )
    bench.add_argument("--json", type=Path, default=None, help="write the figures to this file")


def serve_config(args: argparse.Namespace):
    from ragkv.api.config import ServeConfig

    return config_from_args(
        ServeConfig, args, runtime=runtime_config(args, show_progress=False), api_keys_file=args.api_keys_file
    )


def run(args: argparse.Namespace) -> int:
    if args.action in ("bench", "followup"):
        return _run_bench(args)
    import uvicorn

    from ragkv.api.app import create_app
    from ragkv.cli.logs import configure_logging

    config = serve_config(args)
    configure_logging(args.log_level, config.log_format, access_log=config.access_log)
    from ragkv.engine.model_files import resolve_model_dir

    # A model that cannot load (missing, unsupported architecture) is refused here with its
    # reason (exit 2), not as a traceback from the server's startup; a GGUF is materialised
    # now, so the server then starts from the cached folder.
    resolve_model_dir(config.runtime.engine.model)
    app = create_app(config)
    # log_config=None: uvicorn keeps the handlers set above (text or JSON); its access log
    # is off because ragkv.access logs the same requests with request id and tenant.
    uvicorn.run(
        app,
        host=config.host,
        port=config.port,
        log_level=args.log_level,
        log_config=None,
        timeout_graceful_shutdown=10,
        access_log=False,
    )
    return 0


def _run_peer_bench(args: argparse.Namespace, progress) -> dict:
    import tempfile

    from ragkv.api.launcher import ServerProcess
    from ragkv.bench.peer_bench import PeerBenchConfig, run_peer_bench

    if args.dataset is None:
        raise SystemExit("ragkv serve bench --target needs --dataset (MuSiQue-style JSON: ctxs, question)")
    try:
        config = PeerBenchConfig(
            args.dataset, args.examples, args.passages, tuple(args.clients), args.requests, args.max_tokens, args.shape
        )
    except ValueError as exc:
        raise SystemExit(f"serve bench: {exc}") from None
    headers = {"Authorization": f"Bearer {args.bench_key}"} if args.bench_key else {}
    target_headers = {"Authorization": f"Bearer {args.target_key}"} if args.target_key else {}
    server = scratch = None
    url = args.url
    try:
        if url is None:
            scratch = tempfile.TemporaryDirectory(prefix="ragkv-peer-bench-")
            progress(f"starting ragkv serve over {scratch.name} ...")
            server = ServerProcess(["--data-dir", scratch.name, "--max-queued", "256"]).start(timeout_s=900)
            url = server.url
        if args.workload == "pasted":
            from ragkv.bench.pasted_peer_bench import run_pasted_bench

            return run_pasted_bench(url, args.target, config, progress, headers, target_headers)
        if len(args.target) != 1:
            raise SystemExit("ragkv serve bench --workload ingested takes one --target")
        return run_peer_bench(url, args.target[0], config, progress, headers, target_headers)
    finally:
        if server is not None:
            server.stop()
        if scratch is not None:
            scratch.cleanup()


def _run_bench(args: argparse.Namespace) -> int:
    from ragkv.bench.followup_bench import run_followup_bench
    from ragkv.bench.serve_bench import run_serve_bench

    def progress(message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    if args.action == "bench" and args.target:
        results = _run_peer_bench(args, progress)
    elif args.action == "followup" and args.replicas:
        from ragkv.bench.replica_followup_bench import run_replica_followup

        if args.dataset is None:
            raise SystemExit("ragkv serve followup --replicas needs --dataset (MuSiQue-style JSON: ctxs, question)")
        if args.router is not None:
            return _report(_run_router_chats(args, progress), args.json)
        results = run_replica_followup(args.dataset, args.max_tokens, progress, args.shared_publish_wait_s)
    else:
        bench = run_followup_bench if args.action == "followup" else run_serve_bench
        results = bench(args, progress=progress)
    return _report(results, args.json)


def _run_router_chats(args: argparse.Namespace, progress) -> dict:
    from ragkv.bench.router_chats_bench import RouterChatsConfig, run_router_chats
    from ragkv.bench.router_process import find_router

    try:
        config = RouterChatsConfig(
            args.dataset,
            find_router(args.router or None),
            max(args.clients),
            args.turns,
            args.passages,
            args.max_tokens,
            args.rounds,
        )
    except ValueError as error:
        raise SystemExit(f"ragkv serve followup --router: {error}") from None
    return run_router_chats(config, progress)


def _report(results: dict, path: Path | None) -> int:
    print(json.dumps(results, indent=2))
    if path:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(results, indent=2))
        print(f"wrote {path}", file=sys.stderr)
    return 0


COMMAND = Command(
    "serve",
    "serve the HTTP API (FastAPI + uvicorn); `ragkv serve bench` benchmarks it",
    configure,
    run,
    description=__doc__,
)
