"""`ragkv bench ingest`: ingestion tokens/s on dev documents, beside a llama-server's prompt
processing of the same documents (--peer URL)."""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from ragkv.cli.options import add_common_options, runtime_config


def configure(parser: argparse.ArgumentParser) -> None:
    add_common_options(parser)
    parser.add_argument("--data", type=Path, required=True, help="CacheBlend-style JSON (e.g. musique_dev.json)")
    parser.add_argument("--limit", type=int, default=10, help="documents: one per example (default: 10)")
    parser.add_argument("--passages", type=int, default=10, help="passages joined per document (default: 10)")
    parser.add_argument(
        "--peer",
        default=None,
        metavar="URL",
        help="also time a llama-server's prompt processing of the same documents (e.g. http://127.0.0.1:8080)",
    )
    parser.add_argument("--json", type=Path, default=None, help="write the figures to this file")


def run(args: argparse.Namespace) -> dict:
    from ragkv.app.runtime import Runtime
    from ragkv.bench.ingest_bench import IngestBenchConfig, run_ingest_bench
    from ragkv.cli.bench_retrieval import _machine

    config = IngestBenchConfig(args.data, args.limit, args.passages, args.peer)
    scratch = None
    if args.data_dir is None:  # a fresh store, so every chunk is computed
        scratch = tempfile.TemporaryDirectory(prefix="ragkv-bench-ingest-")
        args.data_dir = Path(scratch.name)
    try:
        with Runtime(runtime_config(args, show_progress=False)) as runtime:
            result = run_ingest_bench(
                runtime.ingestor, config, progress=lambda line: print(line, file=sys.stderr, flush=True)
            )
    finally:
        if scratch is not None:
            scratch.cleanup()
    result.machine = _machine()
    figures = result.to_json()
    print(json.dumps(figures, indent=2))
    return figures
