"""`ragkv bench kernels`: the attention kernels (Triton, FlashInfer, torch) at a real model's
geometry, checked against the torch reference and timed, and a random-weight decode step."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ragkv.cli.options import add_verbose_option


def _progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def configure(parser: argparse.ArgumentParser) -> None:
    from ragkv.bench.kernel_bench import GEOMETRIES, OP_BACKENDS, STEP_MODES

    parser.add_argument(
        "--geometry",
        choices=sorted(GEOMETRIES),
        default="llama3-8b",
        help="model shapes, weights random (default: llama3-8b)",
    )
    parser.add_argument("--device", default="cuda", help="torch device (default: cuda)")
    parser.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    parser.add_argument(
        "--contexts", nargs="+", type=int, default=[8192, 16384, 32768], help="cached rows (default: 8192 16384 32768)"
    )
    parser.add_argument(
        "--budget", type=float, default=0.06, help="sparse decode: fraction of rows read (default: 0.06)"
    )
    parser.add_argument("--codebook-size", type=int, default=1024, help="centroids per KV head (default: 1024)")
    parser.add_argument(
        "--recompute-ratio",
        type=float,
        default=0.15,
        help="selective attention: fraction of rows recomputed (default: 0.15)",
    )
    parser.add_argument(
        "--ops", nargs="*", choices=list(OP_BACKENDS), default=list(OP_BACKENDS), help="ops timed (default: all)"
    )
    parser.add_argument(
        "--step-modes",
        nargs="*",
        choices=list(STEP_MODES),
        default=list(STEP_MODES),
        help="attention modes of the random-weight decode step (none: skip the step)",
    )
    parser.add_argument("--note", default="", help="free text stored with the results")
    parser.add_argument("--json", type=Path, default=None, help="write all figures to this file")
    add_verbose_option(parser)


def run(args: argparse.Namespace) -> dict:
    import torch

    from ragkv.bench.kernel_bench import GEOMETRIES, KernelBenchConfig, format_table, run_kernel_bench

    config = KernelBenchConfig(
        geometry=GEOMETRIES[args.geometry],
        contexts=tuple(args.contexts),
        dtype=getattr(torch, args.dtype),
        budget=args.budget,
        codebook_size=args.codebook_size,
        recompute_ratio=args.recompute_ratio,
        ops=tuple(args.ops),
        step_modes=tuple(args.step_modes),
        device=args.device,
    )
    result = run_kernel_bench(config, progress=_progress)
    result.note = args.note
    print(format_table(result))
    return result.to_json()
