"""`ragkv bench retrieval`: the dense index on synthetic vectors (--chunks N), or dense / BM25 /
hybrid recall on a question set with distractors (--dev PATH)."""

from __future__ import annotations

import argparse
import json
import platform
from pathlib import Path


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--chunks",
        type=int,
        default=100_000,
        help="synthetic 384-dim chunks in the index, 50 per document (default: 100000)",
    )
    parser.add_argument("--queries", type=int, default=200, help="timed single queries (default: 200)")
    parser.add_argument(
        "--topics",
        type=int,
        default=None,
        help="topic centres the synthetic clusters are drawn around (default: one per 5000 chunks); "
        "0: flat, independent clusters",
    )
    parser.add_argument(
        "--exact-below",
        type=int,
        default=None,
        help="live rows under which search scans instead of the HNSW graph (default: the index's)",
    )
    parser.add_argument("--expansion-search", type=int, default=None, help="HNSW ef at search (default: the index's)")
    parser.add_argument(
        "--expansion-sweep",
        type=int,
        nargs="*",
        default=[],
        help="also recall and latency at these HNSW search expansions, on the same build",
    )
    parser.add_argument("--expansion-add", type=int, default=None, help="HNSW ef at insertion (default: the index's)")
    parser.add_argument(
        "--dev",
        type=Path,
        default=None,
        help="instead: dense/bm25/hybrid recall on this CacheBlend-style JSON (e.g. musique_dev.json), "
        "every question's passages among all of the set's",
    )
    parser.add_argument("--limit", type=int, default=None, help="--dev: questions (default: all)")
    parser.add_argument("--json", type=Path, default=None, help="write the figures to this file")
    parser.add_argument("--verbose", "-v", action="store_true", help="log at INFO level")


def _dense_config(args: argparse.Namespace):
    from dataclasses import replace

    from ragkv.ingest.index.dense import DenseConfig

    config = DenseConfig()
    graph = config.graph
    if args.expansion_search is not None:
        graph = replace(graph, expansion_search=args.expansion_search)
    if args.expansion_add is not None:
        graph = replace(graph, expansion_add=args.expansion_add)
    exact_below = config.exact_below if args.exact_below is None else args.exact_below
    return DenseConfig(exact_below=exact_below, oversample=config.oversample, graph=graph)


def machine_description() -> str:
    """CPU model, cores and the load average while the figures were taken (a busy machine
    inflates every time)."""
    import os

    model = platform.machine()
    try:
        with open("/proc/cpuinfo") as handle:
            model = next((line.split(":", 1)[1].strip() for line in handle if line.startswith("model name")), model)
    except OSError:
        pass
    load = ", ".join(f"{value:.1f}" for value in os.getloadavg())
    return f"{model}, {os.cpu_count()} cores, load average {load}"


def run(args: argparse.Namespace) -> dict:
    from ragkv.bench.retrieval_bench import SyntheticConfig, as_dict, run_dev, run_synthetic

    if args.dev is not None:
        result = as_dict(run_dev(args.dev, args.limit))
        print(
            f"{result['questions']} questions, {result['passages']} passages (recall = share of the retrieved "
            "passages that are the question's own)"
        )
        print(f"{'mode':8} {'recall@5':>9} {'recall@10':>10} {'ms/query':>9}")
        for mode, figures in result["recall"].items():
            print(f"{mode:8} {figures['at_5']:9.3f} {figures['at_10']:10.3f} {result['search_ms'][mode]:9.2f}")
        print(f"HNSW graph vs exact scan on these embeddings: recall@10 {result['dense_graph_recall_at_10']:.3f}")
    else:
        config = SyntheticConfig(
            chunks=args.chunks,
            queries=args.queries,
            topics=args.topics,
            expansion_sweep=tuple(args.expansion_sweep),
            dense=_dense_config(args),
        )
        result = as_dict(run_synthetic(config))
        result["machine"] = machine_description()
        print(json.dumps(result, indent=2))
    return result
