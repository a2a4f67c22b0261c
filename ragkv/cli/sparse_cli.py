"""`ragkv calibrate` and `ragkv bench sparse`: argument parsing and handlers."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ragkv.cli.config_args import add_config_options, config_from_args
from ragkv.sparse.calibrate import CalibrationConfig


def _progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# -- ragkv calibrate ----------------------------------------------------------------------

def add_sparse_parsers(commands, global_options) -> None:
    """Register `ragkv calibrate` (`ragkv bench sparse` is added by ragkv.cli.bench)."""
    calibrate = commands.add_parser("calibrate", help="build the A2ATS codebook of the model from text (sparse decode)")
    global_options(calibrate)
    calibrate.add_argument("paths", nargs="*", type=Path, help="calibration files or folders")
    calibrate.add_argument("--from-store", action="store_true",
                           help="also calibrate on the tenant's ingested documents (the default when no paths are given)")
    calibrate.add_argument("--no-backfill", action="store_true",
                           help="do not add codes to the tenant's chunks already in the store")
    add_config_options(calibrate, CalibrationConfig)


def run_calibrate(args: argparse.Namespace) -> int:
    from ragkv.ingest.loaders import expand_paths, read_document
    from ragkv.cli.commands import runtime_config
    from ragkv.app.runtime import Runtime
    from ragkv.sparse.calibrate import calibrate
    from ragkv.app.codebooks import save_codebook

    config = config_from_args(CalibrationConfig, args)
    texts = [read_document(path) for path in expand_paths(args.paths)] if args.paths else []
    if args.paths and not texts:
        raise ValueError("no supported files found in the given paths")
    with Runtime(runtime_config(args, show_progress=False)) as runtime:
        if args.from_store or not args.paths:
            texts += [runtime.registry.text(args.tenant, record.doc_id) for record in runtime.registry.list(args.tenant)]
        if not texts:
            raise ValueError("nothing to calibrate on: give files, or ingest documents first")
        engine = runtime.engine
        codebook = calibrate(engine.model, engine.tokenize, texts, engine.chunk_prefix_ids, config, _progress)
        save_codebook(runtime.env, engine.fingerprint, codebook)
        engine.codebook = codebook
        updated = 0 if args.no_backfill else backfill_codes(runtime, args.tenant)
    print(f"codebook {codebook.id}: {codebook.size} centroids x {codebook.shape[0]} layers x {codebook.shape[1]} KV heads, "
          f"b={codebook.offset}, {codebook.info['tokens']} tokens in {codebook.info['seconds']} s; "
          f"stored for model {engine.fingerprint}; codes added to {updated} stored chunk(s)")
    return 0


def backfill_codes(runtime, tenant: str) -> int:
    """Give the tenant's stored chunks codes under the engine's codebook (stale ones replaced)."""
    engine, store, codebook = runtime.engine, runtime.store, runtime.engine.codebook
    done: set[str] = set()
    updated = 0
    for record in runtime.registry.list(tenant):
        for chunk in record.chunks:
            if chunk.chunk_hash in done:
                continue
            done.add(chunk.chunk_hash)
            key = runtime.rag.chunk_key(chunk.chunk_hash)
            tensors = store.get(key)
            if tensors is None or codebook.codes_of(tensors) is not None:
                continue
            fresh = dict(tensors)
            fresh.update(codebook.chunk_tensors(tensors["keys"].to(engine.model.dtype)))
            store.put(key, fresh)
            updated += 1
    return updated


# -- ragkv bench sparse ----------------------------------------------------------------------

def add_sparse_bench_parser(kinds, global_options) -> None:
    from ragkv.bench.sparse_bench import DEFAULT_SELECTORS

    sparse = kinds.add_parser("sparse", help="sparse decode selectors vs dense: recall, answer F1, ms/token, memory")
    global_options(sparse)
    sparse.add_argument("--data", type=Path, required=True, help="CacheBlend-style JSON or LongBench JSONL")
    sparse.add_argument("--limit", type=int, default=4, help="examples for recall and F1 (default: 4; 0 = skip)")
    sparse.add_argument("--passages", type=int, default=None, help="passages per example (default: all)")
    sparse.add_argument("--budget", type=float, default=0.06,
                        help="rows attended per KV head, sinks and window included: fraction or count (default: 0.06)")
    sparse.add_argument("--selectors", nargs="+", default=list(DEFAULT_SELECTORS),
                        help="selector names, or name:field=value,... for variants (fields of SparseConfig)")
    sparse.add_argument("--context-lengths", nargs="*", type=int, default=[2048, 4096, 8192],
                        help="synthetic context lengths for ms/token (default: 2048 4096 8192; none = skip)")
    sparse.add_argument("--max-new-tokens", type=int, default=32)
    sparse.add_argument("--timing-steps", type=int, default=16, help="decode steps timed per selector and length")
    sparse.add_argument("--codebook-size", type=int, default=1024,
                        help="A2ATS centroids when the bench calibrates (no stored codebook)")
    sparse.add_argument("--calibration-tokens", type=int, default=8192)
    sparse.add_argument("--json", type=Path, default=None, help="write all figures to this file")


def run_sparse_bench_command(args: argparse.Namespace) -> dict:
    from ragkv.bench.datasets import load_examples
    from ragkv.bench.sparse_bench import format_table, run_sparse_bench
    from ragkv.cli.commands import runtime_config
    from ragkv.engine import Engine, EngineConfig
    from ragkv.sparse import SELECTOR_NAMES
    from ragkv.sparse.calibrate import calibrate
    from ragkv.app.codebooks import load_codebook
    from ragkv.store.lmdb_env import LMDBEnvironment

    unknown = [name for name in args.selectors if name.partition(":")[0] not in SELECTOR_NAMES]
    if unknown:
        raise ValueError(f"unknown selector(s) {', '.join(unknown)}; choose from {', '.join(SELECTOR_NAMES)}")
    everything = load_examples(args.data, None, args.passages)
    examples = everything[: args.limit] if args.limit else []
    held_out = everything[args.limit :] or everything
    engine = Engine(config_from_args(EngineConfig, args))
    lmdb_path = runtime_config(args).lmdb_path
    if lmdb_path.is_dir():
        with LMDBEnvironment(lmdb_path) as env:
            engine.codebook = load_codebook(env, engine.fingerprint)
    if engine.codebook is None and any(name.startswith("a2ats") for name in args.selectors):
        _progress("no stored A2ATS codebook for this model: calibrating on held-out passages (not stored)")
        texts = [passage for example in held_out[:40] for passage in example.passages]
        config = CalibrationConfig(codebook_size=args.codebook_size, tokens=args.calibration_tokens)
        engine.codebook = calibrate(engine.model, engine.tokenize, texts, engine.chunk_prefix_ids, config, _progress)
    results = run_sparse_bench(
        engine, examples, everything, selectors=args.selectors, budget=args.budget,
        context_lengths=args.context_lengths or (), max_new_tokens=args.max_new_tokens,
        timing_steps=args.timing_steps, progress=_progress,
    )
    print(format_table(results))
    return results
