"""`ragkv bench decode`: dense decode ms/token, batched tokens/s and first-token quality per numerics option."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ragkv.cli.options import add_verbose_option


def _progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def configure(decode: argparse.ArgumentParser) -> None:
    from ragkv.bench.decode_bench import PYTHON_LOOP, option_names

    decode.add_argument(
        "--model",
        default=None,
        help="GGUF file, local Hugging Face folder or cached hub id (default: packaged SmolLM2)",
    )
    decode.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    decode.add_argument(
        "--options",
        nargs="+",
        default=["auto", "float32", "int8-f32kv", "int8-bf16kv"],
        choices=option_names(),
        help=f"numerics options to measure; a {PYTHON_LOOP} suffix forces the Python forward loop "
        "(default: auto float32 int8-f32kv int8-bf16kv)",
    )
    decode.add_argument(
        "--contexts",
        nargs="*",
        type=int,
        default=[2048, 4096, 8192],
        help="cached rows for ms/token (default: 2048 4096 8192)",
    )
    decode.add_argument("--batches", nargs="*", type=int, default=[1, 4, 8], help="batch sizes (default: 1 4 8)")
    decode.add_argument("--batch-context", type=int, default=2048, help="cached rows per batched request")
    decode.add_argument("--steps", type=int, default=32, help="timed greedy steps per measurement (default: 32)")
    decode.add_argument("--dataset", type=Path, default=None, help="CacheBlend-style JSON for quality (none = skip)")
    decode.add_argument("--examples", type=int, default=10, help="dev examples for quality (default: 10)")
    decode.add_argument("--passages", type=int, default=None, help="passages per example (default: all)")
    decode.add_argument("--max-new-tokens", type=int, default=16, help="greedy answer length compared (default: 16)")
    decode.add_argument("--note", default="", help="free text stored with the results (e.g. machine load)")
    decode.add_argument("--json", "--out", dest="json", type=Path, default=None, help="write all figures to this file")
    add_verbose_option(decode)


def run(args: argparse.Namespace) -> dict:
    import torch
    from transformers import AutoTokenizer

    from ragkv.bench.datasets import load_examples
    from ragkv.bench.decode_bench import format_table, rag_prompts, run_decode_bench
    from ragkv.engine.model import CausalLM
    from ragkv.engine.model_files import resolve_model_dir
    from ragkv.engine.prompt import DEFAULT_SYSTEM_PROMPT, ChatPrompt

    if args.steps < 1 or args.examples < 0:
        raise ValueError("--steps must be >= 1 and --examples >= 0")
    if args.threads:
        torch.set_num_threads(args.threads)
    model_dir = resolve_model_dir(args.model)
    prompts = []
    if args.dataset is not None and args.examples:
        prompt = ChatPrompt(AutoTokenizer.from_pretrained(model_dir), DEFAULT_SYSTEM_PROMPT)
        examples = load_examples(args.dataset, args.examples, args.passages)
        prompts = rag_prompts(prompt.encode, prompt.rag_segments, examples)
    result = run_decode_bench(
        lambda numerics: CausalLM.load(model_dir, numerics=numerics),
        prompts,
        options=args.options,
        contexts=args.contexts,
        batches=args.batches,
        batch_context=args.batch_context,
        steps=args.steps,
        max_new_tokens=args.max_new_tokens,
        progress=_progress,
    )
    result.note = args.note
    print(format_table(result))
    return result.to_json()
