"""`ragkv bench vllm-connector`: vLLM with RagkvConnector against vLLM alone (ragkv.bench.vllm_connector_bench)."""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from ragkv.cli.options import add_verbose_option


def _range(text: str) -> tuple[int, int]:
    start, _, end = text.partition(":")
    return int(start), int(end)


def configure(parser: argparse.ArgumentParser) -> None:
    from ragkv.bench.vllm_server import DEFAULT_PYTHON

    parser.add_argument("--data", type=Path, required=True, help="CacheBlend-style JSON (e.g. musique_dev.json)")
    parser.add_argument("--examples", type=_range, default=(50, 58), help="START:END of the dataset (default 50:58)")
    parser.add_argument("--passages", type=int, default=10)
    parser.add_argument(
        "--vllm-python", type=Path, default=DEFAULT_PYTHON, help=f"vLLM's environment (default {DEFAULT_PYTHON})"
    )
    parser.add_argument("--model", type=Path, required=True, help="the Hugging Face folder vLLM and ragkv both load")
    parser.add_argument(
        "--strategies", nargs="+", default=["probe"], help="fusion strategies, one request each (default: probe)"
    )
    parser.add_argument(
        "--seen",
        choices=("prompt", "alone"),
        default="prompt",
        help="passages seen before in the whole prompt in another order (default), or each alone",
    )
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--logprobs", type=int, default=100, help="top logprobs the first-token KL reads")
    parser.add_argument("--work-dir", type=Path, default=None, help="store and vLLM log (default: a scratch folder)")
    parser.add_argument("--json", type=Path, default=None, help="write the figures to this file")
    add_verbose_option(parser)


def run(args: argparse.Namespace) -> dict:
    from ragkv.bench.vllm_connector_bench import ConnectorBenchConfig, run_connector_bench
    from ragkv.bench.vllm_server import vllm_available

    reason = vllm_available(args.vllm_python)
    if reason is not None:
        raise ValueError(reason)
    config = ConnectorBenchConfig(
        python=args.vllm_python,
        model=args.model,
        dataset=args.data,
        examples=args.examples,
        passages=args.passages,
        max_tokens=args.max_tokens,
        logprobs=args.logprobs,
        strategies=tuple(args.strategies),
        seen=args.seen,
    )
    scratch = tempfile.TemporaryDirectory(prefix="ragkv-vllm-bench-") if args.work_dir is None else None
    work_dir = args.work_dir or Path(scratch.name)
    work_dir.mkdir(parents=True, exist_ok=True)
    try:
        result = run_connector_bench(config, work_dir, lambda line: print(line, file=sys.stderr, flush=True))
    finally:
        if scratch is not None:
            scratch.cleanup()
    print(json.dumps(result["summary"], indent=2))
    return result
