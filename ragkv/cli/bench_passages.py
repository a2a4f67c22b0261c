"""`ragkv bench passages`: passages pasted into the prompt, reused from the store wherever
they stand (ragkv.bench.passages_bench): fidelity against the full prefill on dev examples,
or (--sustained) the span hit rate and TTFT over many queries with the store capped."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ragkv.cli.options import add_common_options, config_from_args
from ragkv.store.recency import DEFAULT_PROTECTED_SHARE


def configure(parser: argparse.ArgumentParser) -> None:
    add_common_options(parser)
    parser.add_argument("--data", type=Path, required=True, help="CacheBlend-style JSON (e.g. musique_dev.json)")
    parser.add_argument(
        "--examples", default="50:70", help="fidelity: the examples START:END of the dataset (default: 50:70)"
    )
    parser.add_argument("--strategy", default="probe", help="fusion strategy spec (default: the product's, probe)")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0, help="the shuffles and the sustained run's draws")
    parser.add_argument(
        "--methods",
        action="store_true",
        help="only the span finder: per prompt shape, the share of the next prompt's reusable tokens served by "
        "whole-span keys, by a rolling hash, and by spans with anchors (the tokenizer of --model; no weights loaded)",
    )
    parser.add_argument(
        "--shapes",
        nargs="?",
        const="all",
        default=None,
        metavar="NAMES",
        help="each prompt shape a real RAG app sends (comma-separated names, default all: "
        "blank_lines, open_webui, anythingllm, langchain_hub, llamaindex, json_lines, splitter): "
        "the reusable share of the next question's prompt served from cache, fidelity and TTFT",
    )
    sustained = parser.add_argument_group("sustained load (--sustained)")
    sustained.add_argument(
        "--sustained", action="store_true", help="the pool run: every passage of the dataset, many queries"
    )
    add_pool_workload(sustained)
    sustained.add_argument(
        "--protected-share",
        type=float,
        default=DEFAULT_PROTECTED_SHARE,
        help="the store's share kept for passages read since stored (segmented LRU; 0: plain LRU)",
    )
    sustained.add_argument("--window", type=int, default=50, help="queries per reported window")
    parser.add_argument("--json", type=Path, default=None, help="write all figures to this file")


def add_pool_workload(group: argparse._ActionsGroup) -> None:
    """The sustained workload's options (also `bench eviction`'s)."""
    group.add_argument("--queries", type=int, default=500)
    group.add_argument("--min-passages", type=int, default=6)
    group.add_argument("--max-passages", type=int, default=10)
    group.add_argument(
        "--capacity-share", type=float, default=0.25, help="the store's cap as a share of the pool's KV bytes"
    )
    group.add_argument(
        "--zipf",
        type=float,
        default=0.0,
        help="draw passages by a Zipf law of this exponent over a random ranking (0: uniform)",
    )
    group.add_argument("--one-off-blocks", type=int, default=0, help="blocks per query that no other query pastes")
    group.add_argument(
        "--popularity-shift",
        type=int,
        default=None,
        metavar="QUERY",
        help="with --zipf: from this query on, a new ranking (what was popular no longer is)",
    )
    group.add_argument(
        "--passage-words",
        type=int,
        default=None,
        help="cut each pool passage to its first N words (a shorter run; the store's cap follows the pool)",
    )


def pool_of(args: argparse.Namespace, examples: list) -> list[str]:
    """Every passage of the dataset, cut to --passage-words."""
    pool = sorted({p.strip() for e in examples for p in e.passages})
    if args.passage_words:
        pool = sorted({" ".join(p.split()[: args.passage_words]) for p in pool})
    return pool


def pool_workload_of(args: argparse.Namespace, cls: type | None = None, **extra):
    """The PoolWorkload (or subclass `cls`) the options name; a bad one exits with its message."""
    from ragkv.bench.passages_bench import PoolWorkload

    try:
        return (cls or PoolWorkload)(
            queries=args.queries,
            passages_per_query=(args.min_passages, args.max_passages),
            capacity_share=args.capacity_share,
            zipf=args.zipf,
            one_off_blocks=args.one_off_blocks,
            shift_at=args.popularity_shift,
            **extra,
        )
    except ValueError as exc:
        raise SystemExit(str(exc)) from None


def run(args: argparse.Namespace) -> dict:
    from ragkv.bench.datasets import load_examples
    from ragkv.bench.passages_bench import run_passage_fidelity, run_sustained
    from ragkv.cli.bench import _write_json
    from ragkv.engine import Engine, EngineConfig
    from ragkv.fusion import build_strategy

    def progress(message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    strategy = build_strategy(args.strategy)
    examples = load_examples(args.data)
    if args.methods:
        return _methods(args, examples)
    if args.shapes is not None:
        shapes = _shape_names(args.shapes)
    if args.sustained:  # a bad workload exits before the model loads
        workload = pool_workload_of(args)
        if not 0 <= args.protected_share < 1:
            raise SystemExit("need 0 <= --protected-share < 1")
    engine = Engine(config_from_args(EngineConfig, args))
    checkpoint = lambda partial: _write_json(args.json, partial)  # noqa: E731
    if args.sustained:
        pool = pool_of(args, examples)
        results = run_sustained(
            engine,
            pool,
            [e.question for e in examples],
            strategy,
            workload,
            protected_share=args.protected_share,
            window=args.window,
            seed=args.seed,
            progress=progress,
            checkpoint=checkpoint,
        )
        print(f"{len(pool)} passages, store capped at {results['store_capacity_bytes'] / 2**20:.0f} MiB")
        for window in results["windows"]:
            first, last = window["queries"]
            print(
                f"queries {first:>4}-{last:<4} hit rate {window['span_hit_rate']:.3f}  cached "
                f"{window['cached_share']:.3f}  TTFT p50 {window['ttft_p50_s']:.2f} s"
            )
        if "hit_rate_trend" in results:
            trend = results["hit_rate_trend"]
            print(
                f"queries 101-200 hit rate {results['hit_rate_queries_101_200']:.3f}, last 100 "
                f"{results['hit_rate_last_100']:.3f}; trend from query 101: {trend['slope_per_100']:+.4f} "
                f"+- {trend['stderr_per_100']:.4f} per 100 queries"
            )
        return results
    start, _, end = args.examples.partition(":")
    chosen = examples[int(start) : int(end)]
    if not chosen:
        raise SystemExit(f"the dataset has no examples in {args.examples}")
    if args.shapes is not None:
        return _shapes(args, engine, chosen, strategy, shapes, progress, checkpoint)
    results = run_passage_fidelity(
        engine,
        chosen,
        strategy,
        max_new_tokens=args.max_new_tokens,
        seed=args.seed,
        progress=progress,
        checkpoint=checkpoint,
    )
    warm, cold = results["warm"], results["cold"]
    print(
        f"{results['examples']} examples: warm (shuffled) first-token KL {warm['first_token_kl']:.3f}, TF agreement "
        f"{warm['teacher_forced_agreement']:.3f}, TF KL {warm['teacher_forced_kl']:.3f}, speed-up "
        f"{warm['speedup_median']:.2f}x median, {warm['cached_share']:.2f} of the prompt cached; cold "
        f"{cold['slowdown_total']:.2f}x the full prefill's time"
    )
    return results


def _methods(args: argparse.Namespace, examples: list) -> dict:
    from transformers import AutoTokenizer

    from ragkv.bench.span_methods import run_span_methods
    from ragkv.engine.model_files import resolve_model_dir
    from ragkv.engine.prompt import ChatPrompt

    folder = resolve_model_dir(args.model)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    start, _, end = args.examples.partition(":")
    results = run_span_methods(ChatPrompt(tokenizer), tokenizer, examples[int(start) : int(end)], args.seed)
    print(f"share of the next prompt's reusable tokens served, per shape and method ({folder.name}):")
    for name, row in results.items():
        print(f"  {name:<14} " + "  ".join(f"{method} {share:.3f}" for method, share in row.items()))
    return {"model": folder.name, "examples": args.examples, "formats": results}


def _shape_names(spec: str) -> list[str]:
    """The shapes --shapes names; an unknown one exits with the known names."""
    from ragkv.bench.prompt_shapes import SHAPES
    from ragkv.bench.shapes_bench import SPLITTER

    known = [*SHAPES, SPLITTER]
    names = known if spec == "all" else [name.strip() for name in spec.split(",") if name.strip()]
    unknown = [name for name in names if name not in known]
    if unknown or not names:
        raise SystemExit(f"--shapes: unknown {unknown or spec!r}; known: {', '.join(known)}")
    return names


def _shapes(args, engine, examples, strategy, shapes, progress, checkpoint) -> dict:
    from ragkv.bench.shapes_bench import run_shapes

    if len(examples) < 2:
        raise SystemExit("--shapes needs at least two examples (the next one brings the new passages)")
    results = run_shapes(
        engine,
        examples,
        strategy,
        shapes,
        max_new_tokens=args.max_new_tokens,
        seed=args.seed,
        progress=progress,
        checkpoint=checkpoint,
    )
    print(f"{'shape':<14} {'reusable':>8} {'served':>7} {'KL':>7} {'TF':>6} {'speed-up':>8} {'escalated':>9}")
    for name, row in results["shapes"].items():
        print(
            f"{name:<14} {row['reusable_share']:>8.2f} {row['served_share']:>7.3f} {row['first_token_kl']:>7.4f} "
            f"{row['teacher_forced_agreement']:>6.3f} {row['speedup_total']:>7.1f}x {row['escalated_share']:>9.2f}"
        )
    return results
