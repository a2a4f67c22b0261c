"""The handlers behind `ragkv ingest | ask | docs | bench`."""

from __future__ import annotations

import argparse
import json
import sys

from ragkv.ingest.errors import InputError
from ragkv.ingest.loaders import expand_paths, read_document
from ragkv.ingest.pipeline import IngestConfig
from ragkv.cli.config_args import config_from_args
from ragkv.engine import EngineConfig
from ragkv.fusion import FusionConfig
from ragkv.engine.generation import GenerationConfig
from ragkv.app.rag import QueryConfig
from ragkv.app.runtime import Runtime, RuntimeConfig, default_data_dir
from ragkv.engine.sampling import SamplingConfig
from ragkv.sparse import SparseConfig


def runtime_config(args: argparse.Namespace, **ingest_overrides) -> RuntimeConfig:
    return RuntimeConfig(
        data_dir=args.data_dir or default_data_dir(),
        store_url=args.store,
        engine=config_from_args(EngineConfig, args),
        ingest=IngestConfig(**ingest_overrides),
    )


def run_ingest(args: argparse.Namespace) -> int:
    overrides = {"show_progress": not args.no_progress}
    if args.chunk_tokens:
        overrides["chunk_tokens"] = args.chunk_tokens
    paths = expand_paths(args.paths)
    if not paths:
        raise InputError("missing", "no supported files found in the given paths")
    failures = 0
    with Runtime(runtime_config(args, **overrides)) as runtime:
        for path in paths:
            try:
                result = runtime.ingestor.ingest_text(read_document(path), str(path), tenant=args.tenant)
            except InputError as error:
                failures += 1
                print(f"skipped {path}: {error}", file=sys.stderr)
                continue
            note = " (identical text already ingested)" if result.duplicate_of_existing else ""
            print(
                f"{result.doc_id}  {path}  {result.tokens} tokens, {result.chunks} chunks "
                f"({result.computed_chunks} computed, {result.reused_chunks} reused), "
                f"{result.tokens_per_second:.0f} tokens/s{note}"
            )
    return 1 if failures else 0


def run_ask(args: argparse.Namespace) -> int:
    generation = config_from_args(
        GenerationConfig, args, sampling=config_from_args(SamplingConfig, args), stop=tuple(args.stop or ())
    )
    query = QueryConfig(
        top_k=args.top_k,
        doc_ids=tuple(args.doc) if args.doc else None,
        fusion=config_from_args(FusionConfig, args),
        generation=generation,
        sparse=config_from_args(SparseConfig, args, prefix="sparse_") if args.sparse_selector else None,
    )
    with Runtime(runtime_config(args, show_progress=False)) as runtime:
        answer = runtime.rag.ask(args.question, args.tenant, query)
    if args.json:
        print(json.dumps(answer.to_dict(), indent=2))
        return 0
    print(answer.text)
    print()
    for number, citation in enumerate(answer.citations, start=1):
        snippet = " ".join(citation.text.split())[:100]
        print(f"[{number}] {citation.name} chunk {citation.chunk_index} (score {citation.score:.3f}): {snippet}...")
    t = answer.timings
    print(
        f"\nstrategy {answer.strategy}: TTFT {t['ttft']:.2f} s (load {t['load']:.2f} s + fuse {t['fuse']:.2f} s), "
        f"retrieve {t['retrieve']:.2f} s, decode {t['decode']:.2f} s; "
        f"{answer.usage['reused_tokens']} tokens reused, {answer.usage['recomputed_tokens']} recomputed"
    )
    return 0


def run_docs(args: argparse.Namespace) -> int:
    if args.action in ("show", "delete") and not args.doc_id:
        raise InputError("missing_id", f"`ragkv docs {args.action}` needs a document id")
    with Runtime(runtime_config(args, show_progress=False)) as runtime:
        if args.action == "list":
            records = runtime.registry.list(args.tenant)
            for record in records:
                print(f"{record.doc_id}  {record.num_tokens:>7} tokens  {len(record.chunks):>4} chunks  {record.name}")
            if not records:
                print("no documents")
        elif args.action == "show":
            record = runtime.registry.get(args.tenant, args.doc_id)
            print(json.dumps({**record.summary(), "fingerprint": record.fingerprint,
                              "chunks": [vars(chunk) for chunk in record.chunks]}, indent=2))
        else:
            record = runtime.ingestor.delete(args.doc_id, args.tenant)
            print(f"deleted {record.doc_id} ({record.name})")
    return 0


def run_bench(args: argparse.Namespace) -> int:
    from ragkv.cli.bench import run_bench_command

    return run_bench_command(args)


def run_serve(args: argparse.Namespace) -> int:
    from ragkv.cli.serve import run_serve_command

    return run_serve_command(args)


def run_calibrate(args: argparse.Namespace) -> int:
    from ragkv.cli.sparse_cli import run_calibrate as calibrate

    return calibrate(args)


__all__ = ["run_ingest", "run_ask", "run_docs", "run_bench", "run_serve", "run_calibrate"]
