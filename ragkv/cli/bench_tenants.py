"""`ragkv bench tenants`: tenant A's hit rate and TTFT on a capped store while tenant B
pastes new passage sets, recurring or one-off, with and without per-tenant budgets."""

from __future__ import annotations

import argparse
import signal
import sys
from pathlib import Path

from ragkv.cli.options import add_verbose_option


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--data", type=Path, required=True, help="CacheBlend-style JSON (e.g. musique_dev.json)")
    parser.add_argument("--model", default=None, help="the served model (default: the packaged one)")
    parser.add_argument("--a-questions", type=int, default=10, help="A's questions per phase (default: 10)")
    parser.add_argument("--a-pool", type=int, default=8, help="passages A's questions draw from (default: 8)")
    parser.add_argument("--passages", type=int, default=2, help="passages pasted per prompt (default: 2)")
    parser.add_argument("--last", type=int, default=5, help="A's hit rate over its last N questions (default: 5)")
    parser.add_argument("--b-rate", type=float, default=4.0, help="B's requests per A question (default: 4)")
    parser.add_argument("--b-repeats", type=int, default=2, help="recurring B: asks per set (default: 2)")
    parser.add_argument(
        "--passage-words", type=int, default=0, help="passages cut to this many words, 0 whole (default: 0)"
    )
    parser.add_argument("--max-tokens", type=int, default=4, help="tokens per answer (default: 4)")
    parser.add_argument(
        "--cold",
        type=int,
        default=5,
        help="cold prompts sent into the empty store and as many at its cap (default: 5)",
    )
    parser.add_argument(
        "--store-capacity-mb",
        type=float,
        default=None,
        help="the store's cap (default: --capacity-pools x A's bytes, measured on an uncapped start)",
    )
    parser.add_argument(
        "--capacity-pools", type=float, default=3.0, help="the cap in A's stored bytes when not given (default: 3)"
    )
    parser.add_argument(
        "--budget-share", type=float, default=0.5, help="with budgets: each tenant's share of the cap (default: 0.5)"
    )
    parser.add_argument(
        "--modes", nargs="+", default=["recurring", "flood"], help="B's traffic: recurring and/or flood (default: both)"
    )
    parser.add_argument(
        "--budgets", nargs="+", default=["off", "on"], choices=["off", "on"], help="budget settings (default: off on)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--serve-option",
        action="append",
        default=[],
        metavar="OPTION",
        help="a `ragkv serve` option, repeatable: --serve-option=--store-protected-share=0",
    )
    parser.add_argument("--json", type=Path, default=None, help="write the figures to this file")
    add_verbose_option(parser)


def config_of(args: argparse.Namespace):
    """The TenantsConfig the options name; a bad one exits with its message."""
    from ragkv.bench.tenants_workload import TenantsConfig

    try:
        return TenantsConfig(
            dataset=args.data,
            a_questions=args.a_questions,
            a_pool=args.a_pool,
            passages=args.passages,
            last=args.last,
            b_rate=args.b_rate,
            b_repeats=args.b_repeats,
            passage_words=args.passage_words,
            max_tokens=args.max_tokens,
            cold=args.cold,
            capacity_mb=args.store_capacity_mb,
            capacity_pools=args.capacity_pools,
            budget_share=args.budget_share,
            modes=tuple(args.modes),
            budgets=tuple(setting == "on" for setting in dict.fromkeys(args.budgets)),
            seed=args.seed,
            model=args.model,
            serve_options=tuple(args.serve_option),
        )
    except ValueError as exc:
        raise SystemExit(f"ragkv bench tenants: {exc}") from None


def run(args: argparse.Namespace) -> dict:
    from ragkv.bench.datasets import load_examples
    from ragkv.bench.tenants_bench import run_tenants
    from ragkv.bench.tenants_workload import Traffic

    config = config_of(args)
    examples = load_examples(config.dataset)
    try:
        Traffic(config, examples, len)  # enough passages for B, before a server starts
    except ValueError as exc:
        raise SystemExit(f"ragkv bench tenants: {exc}") from None
    # a SIGTERM unwinds like Ctrl-C, so the servers started here stop too
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    result = run_tenants(config, examples, progress=lambda message: print(message, file=sys.stderr, flush=True))
    _print_table(result)
    return result.to_json()


def _print_table(result) -> None:
    print(f"store cap {result.capacity_bytes / 2**20:.2f} MiB")
    print(
        "mode       budgets  A hit alone  beside B  change  A TTFT p50 alone  beside B  ratio  B reqs  "
        "evicted A/B  goals  cold TTFT empty  at cap  ratio"
    )
    for run in result.runs:
        alone, beside = run.alone, run.beside_b
        evicted = beside.evictions
        print(
            f"{run.mode:<10} {'on' if run.budgets else 'off':<8} {_fmt(alone.a_hit_rate_last):>11}  "
            f"{_fmt(beside.a_hit_rate_last):>8}  {_fmt(run.hit_rate_change):>6}  "
            f"{_fmt(alone.a_ttft_p50_last_s):>14} s  {_fmt(beside.a_ttft_p50_last_s):>6} s  {_fmt(run.ttft_ratio):>5}  "
            f"{beside.b_requests:>6}  {evicted.get('A', 0):>5.0f}/{evicted.get('B', 0):<5.0f}  {run.meets_goals!s:<5}  "
            f"{_fmt(run.cold_ttft_p50_empty_s):>13} s  {_fmt(run.cold_ttft_p50_at_cap_s):>6} s  "
            f"{_fmt(run.cold_ratio):>5}"
        )


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"
