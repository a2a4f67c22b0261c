"""`ragkv bench soak`: two replicas under mixed load with a Redis restart and a replica kill."""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import sys
import tempfile
from pathlib import Path

from ragkv.cli.options import add_verbose_option


def configure(soak: argparse.ArgumentParser) -> None:
    soak.add_argument("--minutes", type=float, default=10.0, help="length of the loaded run (default: 10)")
    soak.add_argument("--clients", type=int, default=4, help="concurrent clients (default: 4)")
    soak.add_argument("--max-tokens", type=int, default=8, help="answer tokens per request (default: 8)")
    soak.add_argument("--seed", type=int, default=0)
    soak.add_argument(
        "--serve-option",
        action="append",
        default=[],
        metavar="OPTION",
        help="a `ragkv serve` option for both replicas, repeatable: --serve-option=--session-memory-mb=256",
    )
    soak.add_argument(
        "--data-dir",
        type=Path,
        default=None,
        help="where the replicas' data folders and logs go (default: a scratch folder, removed)",
    )
    soak.add_argument("--json", type=Path, default=None, help="write the figures to this file")
    add_verbose_option(soak)


def run(args: argparse.Namespace) -> dict:
    from ragkv.bench.soak_bench import SoakConfig, run_soak

    config = SoakConfig(
        minutes=args.minutes,
        clients=args.clients,
        max_tokens=args.max_tokens,
        seed=args.seed,
        serve_options=tuple(args.serve_option),
    )
    if shutil.which("redis-server") is None:
        raise ValueError("the soak starts its own redis-server: install it (Debian: apt-get install redis-server)")
    scratch = None
    if args.data_dir is None:
        scratch = tempfile.TemporaryDirectory(prefix="ragkv-soak-")
    data_dir = args.data_dir or Path(scratch.name)
    data_dir.mkdir(parents=True, exist_ok=True)
    # A SIGTERM unwinds like Ctrl-C, so the replicas and the redis-server the soak started are stopped too.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        result = run_soak(config, data_dir, progress=lambda message: print(message, file=sys.stderr, flush=True))
    finally:
        if scratch is not None:
            scratch.cleanup()
    figures = result.to_json()
    print(
        json.dumps(
            {
                key: figures[key]
                for key in (
                    "requests",
                    "requests_per_s",
                    "errors_on_survivor",
                    "errors_on_killed",
                    "errors_by_cause",
                    "documents_acknowledged",
                    "lost_documents",
                    "rss_growth_last_half",
                    "faults",
                )
            },
            indent=2,
        )
    )
    return figures
