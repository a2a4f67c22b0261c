"""`ragkv bench eviction`: the sustained passage workload replayed against a capped LMDB
store, no model (ragkv.bench.eviction_bench), over many seeds and protected shares."""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

from ragkv.cli.bench_passages import add_pool_workload, pool_of, pool_workload_of
from ragkv.cli.options import add_common_options
from ragkv.store.recency import DEFAULT_PROTECTED_SHARE


def configure(parser: argparse.ArgumentParser) -> None:
    add_common_options(parser)  # --model: whose tokenizer sizes the passages
    parser.add_argument("--data", type=Path, required=True, help="CacheBlend-style JSON (e.g. musique_dev.json)")
    parser.add_argument("--seeds", type=int, default=40, help="seeds 0..N-1 (default: 40)")
    parser.add_argument(
        "--protected-shares",
        type=float,
        nargs="+",
        default=[0.0, DEFAULT_PROTECTED_SHARE],
        help="store policies compared: the share kept for passages read since stored (0: plain LRU)",
    )
    add_pool_workload(parser)
    parser.add_argument("--json", type=Path, default=None, help="write all figures to this file")


def run(args: argparse.Namespace) -> dict:
    from transformers import AutoTokenizer

    from ragkv.bench.datasets import load_examples
    from ragkv.bench.eviction_bench import Replay, run_eviction_replay
    from ragkv.engine.model_files import resolve_model_dir

    if args.seeds < 1 or any(not 0 <= share < 1 for share in args.protected_shares):
        raise SystemExit("need --seeds >= 1 and every --protected-shares value in [0, 1)")
    examples = load_examples(args.data)
    pool = pool_of(args, examples)
    replay = pool_workload_of(args, Replay, questions=len(examples))
    folder = resolve_model_dir(args.model)
    tokenizer = AutoTokenizer.from_pretrained(folder)

    @functools.cache
    def tokens(text: str) -> int:
        return max(1, len(tokenizer.encode(text, add_special_tokens=False)))

    results = run_eviction_replay(
        pool,
        tokens,
        replay,
        args.protected_shares,
        list(range(args.seeds)),
        progress=lambda message: print(message, file=sys.stderr, flush=True),
    )
    print(f"{len(pool)} passages, {args.seeds} seeds, zipf {args.zipf}, {args.one_off_blocks} one-off blocks/query")
    for name, row in results["policies"].items():
        print(
            f"protected {name:<4} hit rate 101-200 {row['hit_rate_queries_101_200']:.3f}  last 100 "
            f"{row['hit_rate_last_100']:.3f}  all {row['hit_rate_all']:.3f}  last >= 101-200 in "
            f"{row['last_100_reaches_101_200']:.0%}  trend {row['trend_per_100_mean']:+.4f}/100 queries"
        )
        print("  per 50 queries: " + " ".join(f"{rate:.3f}" for rate in row["hit_rate_per_50"]))
    return {"model": folder.name, "passage_words": args.passage_words, **results}
