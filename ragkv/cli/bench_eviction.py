"""`ragkv bench eviction`: the sustained passage workload replayed against a capped LMDB
store, no model (ragkv.bench.eviction_bench), over many seeds and protected shares."""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

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
    parser.add_argument("--queries", type=int, default=500)
    parser.add_argument("--min-passages", type=int, default=6)
    parser.add_argument("--max-passages", type=int, default=10)
    parser.add_argument("--capacity-share", type=float, default=0.25)
    parser.add_argument("--zipf", type=float, default=0.0, help="Zipf exponent of the draws (0: uniform)")
    parser.add_argument("--one-off-blocks", type=int, default=0, help="blocks per query no other query pastes")
    parser.add_argument("--passage-words", type=int, default=None, help="cut each pool passage to N words")
    parser.add_argument("--json", type=Path, default=None, help="write all figures to this file")


def run(args: argparse.Namespace) -> dict:
    from transformers import AutoTokenizer

    from ragkv.bench.datasets import load_examples
    from ragkv.bench.eviction_bench import Replay, run_eviction_replay
    from ragkv.engine.model_files import resolve_model_dir

    if args.seeds < 1 or any(not 0 <= share < 1 for share in args.protected_shares):
        raise SystemExit("need --seeds >= 1 and every --protected-shares value in [0, 1)")
    try:
        replay = Replay(
            queries=args.queries,
            passages_per_query=(args.min_passages, args.max_passages),
            capacity_share=args.capacity_share,
            zipf=args.zipf,
            one_off_blocks=args.one_off_blocks,
        )
    except ValueError as exc:
        raise SystemExit(str(exc)) from None
    examples = load_examples(args.data)
    pool = sorted({p.strip() for e in examples for p in e.passages})
    if args.passage_words:
        pool = sorted({" ".join(p.split()[: args.passage_words]) for p in pool})
    replay = Replay(**{**replay.__dict__, "questions": len(examples)})
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
    return {"model": folder.name, "passage_words": args.passage_words, **results}
