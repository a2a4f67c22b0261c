"""Argument parsing and dispatch for `ragkv`."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from ragkv.cli.config_args import add_config_options
from ragkv.engine import EngineConfig
from ragkv.fusion import FusionConfig
from ragkv.engine.generation import GenerationConfig
from ragkv.engine.sampling import SamplingConfig
from ragkv.sparse import SparseConfig


def _global_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--data-dir", type=Path, default=None, help="data folder (default: $RAGKV_HOME or ~/.ragkv)")
    parser.add_argument("--store", default=None, help="chunk store URL (default: lmdb://<data-dir>/db)")
    parser.add_argument("--tenant", default="default", help="tenant whose documents are used (default: default)")
    parser.add_argument("-v", "--verbose", action="store_true", help="log what ragkv does")
    add_config_options(parser, EngineConfig, skip=("device", "system_prompt"))


def _generation_options(parser: argparse.ArgumentParser) -> None:
    add_config_options(parser, GenerationConfig, skip=("stop",))
    add_config_options(parser, SamplingConfig)
    parser.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ragkv", description="RAG serving over precomputed chunk KV caches")
    commands = parser.add_subparsers(dest="command", required=True)

    ingest = commands.add_parser("ingest", help="ingest files or folders (.txt, .md, .rst, .csv, .html, ...)")
    _global_options(ingest)
    ingest.add_argument("paths", nargs="+", type=Path)
    ingest.add_argument("--chunk-tokens", type=int, default=None, help="tokens per chunk (default: 512)")
    ingest.add_argument("--no-progress", action="store_true", help="no progress bars")

    ask = commands.add_parser("ask", help="answer a question from the ingested documents")
    _global_options(ask)
    ask.add_argument("question")
    ask.add_argument("--top-k", type=int, default=5, help="chunks retrieved (default: 5)")
    ask.add_argument("--doc", action="append", default=None, help="restrict retrieval to this document id (repeatable)")
    ask.add_argument("--json", action="store_true", help="print the whole answer as JSON")
    add_config_options(ask, FusionConfig)
    add_config_options(ask, SparseConfig, prefix="sparse_")
    _generation_options(ask)

    docs = commands.add_parser("docs", help="list, show or delete documents")
    _global_options(docs)
    docs.add_argument("action", choices=("list", "show", "delete"))
    docs.add_argument("doc_id", nargs="?")

    from ragkv.cli.bench import add_bench_parser
    from ragkv.cli.serve import add_serve_parser
    from ragkv.cli.sparse_cli import add_sparse_parsers

    add_bench_parser(commands, _global_options)
    add_sparse_parsers(commands, _global_options)
    add_serve_parser(commands, _global_options)
    return parser


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    from ragkv.cli import commands

    handler = getattr(commands, f"run_{args.command}")
    try:
        return handler(args)
    except (ValueError, KeyError, FileNotFoundError) as error:
        message = error.args[0] if isinstance(error, KeyError) and error.args else error
        print(f"ragkv {args.command}: error: {message}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
