"""`ragkv bench sparse`: sparse decode selectors against dense decode."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ragkv.cli.config_args import config_from_args
from ragkv.cli.options import add_common_options, runtime_config


def _progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def configure(sparse: argparse.ArgumentParser) -> None:
    from ragkv.fusion import DEFAULT_STRATEGY
    from ragkv.sparse import selector_names

    sparse.add_argument("--data", type=Path, required=True, help="CacheBlend-style JSON or LongBench JSONL")
    sparse.add_argument("--limit", type=int, default=4, help="examples for recall and F1 (default: 4; 0 = skip)")
    sparse.add_argument("--passages", type=int, default=None, help="passages per example (default: all)")
    sparse.add_argument(
        "--budget",
        type=float,
        default=0.06,
        help="rows attended per KV head, sinks and window included: fraction or count (default: 0.06)",
    )
    sparse.add_argument(
        "--selectors",
        nargs="+",
        default=list(selector_names()),
        help="selector specs, name or name:option=value,... (the selector's options, or "
        "head_aggregation, sinks, window, backend)",
    )
    sparse.add_argument(
        "--context-lengths",
        nargs="*",
        type=int,
        default=[2048, 4096, 8192],
        help="synthetic context lengths for ms/token (default: 2048 4096 8192; none = skip)",
    )
    sparse.add_argument("--max-new-tokens", type=int, default=32)
    sparse.add_argument("--timing-steps", type=int, default=16, help="decode steps timed per selector and length")
    sparse.add_argument(
        "--codebook-size", type=int, default=1024, help="A2ATS centroids when the bench calibrates (no stored codebook)"
    )
    sparse.add_argument("--calibration-tokens", type=int, default=8192)
    sparse.add_argument(
        "--path",
        choices=("user", "prefill"),
        default="user",
        help="quality prompts: 'user' = passages encoded as ingestion stores them (codes included) "
        "and fused by --fusion; 'prefill' = a plain prefill (default: user)",
    )
    sparse.add_argument(
        "--fusion",
        default=DEFAULT_STRATEGY,
        help="fusion strategy spec for --path user (default: %(default)s, the product default, as `ragkv ask`)",
    )
    sparse.add_argument("--json", type=Path, default=None, help="write all figures to this file")
    add_common_options(sparse)


def run(args: argparse.Namespace) -> dict:
    from ragkv.app.codebooks import load_codebook
    from ragkv.bench.datasets import load_examples
    from ragkv.bench.sparse_bench import format_table, run_sparse_bench, selector_config
    from ragkv.engine import Engine, EngineConfig
    from ragkv.sparse.calibrate import CalibrationConfig, calibrate
    from ragkv.store.lmdb_env import LMDBEnvironment

    configs = [selector_config(spec, args.budget) for spec in args.selectors]  # a bad spec fails before the model loads
    everything = load_examples(args.data, None, args.passages)
    examples = everything[: args.limit] if args.limit else []
    held_out = everything[args.limit :] or everything
    engine = Engine(config_from_args(EngineConfig, args))
    lmdb_path = runtime_config(args).lmdb_path
    codebook = None
    if lmdb_path.is_dir():
        with LMDBEnvironment(lmdb_path) as env:
            codebook = load_codebook(env, engine.fingerprint)
    if codebook is None and any(config.options.needs_codebook for config in configs):
        _progress("no stored A2ATS codebook for this model: calibrating on held-out passages (not stored)")
        texts = [passage for example in held_out[:40] for passage in example.passages]
        config = CalibrationConfig(codebook_size=args.codebook_size, tokens=args.calibration_tokens)
        codebook = calibrate(engine.model, engine.tokenize, texts, engine.chunk_prefix_ids, config, _progress)
    results = run_sparse_bench(
        engine,
        codebook,
        examples,
        everything,
        selectors=args.selectors,
        budget=args.budget,
        context_lengths=args.context_lengths or (),
        max_new_tokens=args.max_new_tokens,
        timing_steps=args.timing_steps,
        path=args.path,
        fusion=args.fusion,
        progress=_progress,
    )
    print(format_table(results))
    return results
