"""`ragkv bench arrivals`: running answers' inter-token latency while ~6K-token pasted
prompts arrive, chunks on a Redis tier with added latency."""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import sys
from pathlib import Path

from ragkv.cli.options import add_verbose_option


def configure(arrivals: argparse.ArgumentParser) -> None:
    arrivals.add_argument("--data", type=Path, required=True, help="CacheBlend-style JSON (e.g. musique_dev.json)")
    arrivals.add_argument("--clients", type=int, default=8, help="clients streaming answers (default: 8)")
    arrivals.add_argument(
        "--interval-s", type=float, default=4.0, help="seconds between two long prompts' arrivals (default: 4)"
    )
    arrivals.add_argument("--phase-s", type=float, default=60.0, help="length of each phase (default: 60)")
    arrivals.add_argument("--max-tokens", type=int, default=64, help="tokens of each running answer (default: 64)")
    arrivals.add_argument(
        "--arrival-passages", type=int, default=10, help="passages pasted into each arriving prompt (default: 10)"
    )
    arrivals.add_argument(
        "--redis-latency-ms", type=float, default=5.0, help="delay added to every Redis reply (default: 5)"
    )
    arrivals.add_argument(
        "--serve-option",
        action="append",
        default=[],
        metavar="OPTION",
        help="a `ragkv serve` option, repeatable: --serve-option=--max-num-batched-tokens=512",
    )
    arrivals.add_argument("--json", type=Path, default=None, help="write the figures to this file")
    add_verbose_option(arrivals)


def run(args: argparse.Namespace) -> dict:
    from ragkv.bench.arrivals_bench import ArrivalsConfig, run_arrivals

    if shutil.which("redis-server") is None:
        raise ValueError("the benchmark starts its own redis-server: install it (Debian: apt-get install redis-server)")
    config = ArrivalsConfig(
        dataset=args.data,
        clients=args.clients,
        interval_s=args.interval_s,
        phase_s=args.phase_s,
        max_tokens=args.max_tokens,
        arrival_passages=args.arrival_passages,
        redis_latency_ms=args.redis_latency_ms,
        serve_options=tuple(args.serve_option),
    )
    # a SIGTERM unwinds like Ctrl-C, so the server and the redis-server started here stop too
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    figures = run_arrivals(config, progress=lambda message: print(message, file=sys.stderr, flush=True)).to_json()
    print(json.dumps({key: figures[key] for key in ("phases", "itl_p99_ratio", "requests_per_s_ratio")}, indent=2))
    return figures
