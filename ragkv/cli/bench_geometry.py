"""`ragkv bench geometry`: fused vs full prefill and decode ms/token of the engine itself at a
real model's geometry (random weights made on the device), beside the decode step's
memory-bandwidth floor. What `scripts/gpu-check.sh` runs on a GPU machine."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ragkv.cli.options import add_verbose_option


def _progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def configure(parser: argparse.ArgumentParser) -> None:
    from ragkv.bench.kernel_bench import GEOMETRIES
    from ragkv.engine.kv_storage import KV_STORAGE_FORMATS
    from ragkv.fusion import DEFAULT_STRATEGY

    parser.add_argument("--geometry", choices=sorted(GEOMETRIES), default="llama3-8b", help="(default: llama3-8b)")
    parser.add_argument("--device", default="cuda", help="torch device (default: cuda)")
    parser.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    parser.add_argument(
        "--lengths", nargs="+", type=int, default=[6144, 32768], help="prompt tokens (default: 6144 32768)"
    )
    parser.add_argument("--strategy", default=DEFAULT_STRATEGY, help=f"fusion spec (default: {DEFAULT_STRATEGY})")
    parser.add_argument(
        "--kv-storage",
        choices=sorted(KV_STORAGE_FORMATS),
        default="int4",
        help="format the chunks are held in on the host, as the store keeps them (default: int4)",
    )
    parser.add_argument("--repeats", type=int, default=3, help="timed runs of each prefill (default: 3)")
    parser.add_argument("--decode-steps", type=int, default=32, help="(default: 32)")
    parser.add_argument("--json", type=Path, default=None, help="write all figures to this file")
    add_verbose_option(parser)


def run(args: argparse.Namespace) -> dict:
    from ragkv.bench.geometry_bench import GeometryBenchConfig, run_geometry_bench
    from ragkv.bench.kernel_bench import GEOMETRIES

    config = GeometryBenchConfig(
        geometry=GEOMETRIES[args.geometry],
        device=args.device,
        dtype=args.dtype,
        lengths=tuple(args.lengths),
        strategy=args.strategy,
        kv_storage=args.kv_storage,
        repeats=args.repeats,
        decode_steps=args.decode_steps,
    )
    return run_geometry_bench(config, progress=_progress).to_json()
