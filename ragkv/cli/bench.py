"""`ragkv bench store | fusion | sparse | decode | kernels | geometry | retrieval | ingest | soak | arrivals |
passages | eviction | tenants | vllm-connector`: argument parsing and result tables (each kind but store, fusion and
conversation in its own module: ragkv.cli.bench_<kind>; vllm-connector: ragkv.cli.bench_vllm)."""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from ragkv.cli import (
    bench_arrivals,
    bench_decode,
    bench_eviction,
    bench_geometry,
    bench_ingest,
    bench_kernels,
    bench_passages,
    bench_retrieval,
    bench_soak,
    bench_sparse,
    bench_tenants,
    bench_vllm,
)
from ragkv.cli.command import Command, CommandParser
from ragkv.cli.options import add_common_options, runtime_config
from ragkv.ingest.config import IngestConfig


def configure(bench: argparse.ArgumentParser) -> None:
    kinds = bench.add_subparsers(dest="bench", required=True, parser_class=CommandParser)

    store = kinds.add_parser("store", help="chunk store throughput; bytes/token, load time and fidelity per KV format")
    add_common_options(store)
    store.add_argument("--chunks", type=int, default=64, help="chunks written and read (default: 64)")
    store.add_argument("--tokens-per-chunk", type=int, default=512)
    store.add_argument("--redis", default=None, help="also bench this redis URL (e.g. redis://127.0.0.1:6379/0)")
    store.add_argument(
        "--formats",
        nargs="+",
        default=None,
        help="KV storage formats compared: float32 float16 bfloat16 int8 int4 (default: all)",
    )
    store.add_argument(
        "--data",
        type=Path,
        default=None,
        help="also measure each format's first-token KL and answer agreement vs float16 on this dataset",
    )
    store.add_argument("--limit", type=int, default=8, help="examples for the fidelity figures (default: 8)")
    store.add_argument("--passages", type=int, default=10, help="passages per example (default: 10)")
    store.add_argument(
        "--strategies",
        nargs="+",
        default=["full_reuse", "a3"],
        help="fusion strategies the fidelity is measured under (default: full_reuse a3)",
    )
    store.add_argument("--ratio", type=float, default=0.15, help="recompute ratio r (default: 0.15)")
    store.add_argument("--max-new-tokens", type=int, default=32)
    store.add_argument("--json", type=Path, default=None, help="write all figures to this file")

    fusion = kinds.add_parser("fusion", help="fusion strategies vs full prefill: fidelity and TTFT")
    add_common_options(fusion)
    fusion.add_argument("--data", type=Path, required=True, help="CacheBlend-style JSON or LongBench JSONL")
    fusion.add_argument("--limit", type=int, default=12, help="examples (default: 12)")
    fusion.add_argument(
        "--examples",
        type=_example_range,
        default=None,
        metavar="START:END",
        help="the examples START..END-1 of the dataset instead of the first --limit (tune on one "
        "range, report on another)",
    )
    fusion.add_argument(
        "--weight-formats",
        nargs="*",
        default=[],
        help="also compare full prefill with these decode-weight formats (int8 int4 bfloat16 ..., "
        "or 'served' for the engine as configured) against float32 on the same prompts",
    )
    fusion.add_argument("--passages", type=int, default=None, help="passages per example (default: all)")
    fusion.add_argument(
        "--strategies",
        nargs="+",
        default=["full_reuse", "pie", "epic", "cacheblend", "a3", "probe"],
        help="strategy specs to compare with the full prefill: name or name:option=value,... "
        "(e.g. a3:ratio=0.3 cacheblend:ratio=0.15)",
    )
    fusion.add_argument("--max-new-tokens", type=int, default=32)
    fusion.add_argument(
        "--context-neighbours",
        type=int,
        default=IngestConfig.context_neighbours,
        help="recompute each ingested chunk's K/V with this many related chunks placed before it "
        "(ingestion's --context-neighbours; use a fresh --data-dir per setting: a passage already "
        f"stored keeps its K/V) (default: {IngestConfig.context_neighbours}, ingestion's)",
    )
    fusion.add_argument("--json", type=Path, default=None, help="write all figures to this file")

    conversation = kinds.add_parser(
        "conversation",
        help="a chat follow-up that fuses one new chunk into a long conversation: TTFT and its parts per context size",
    )
    add_common_options(conversation)
    conversation.add_argument(
        "--data",
        type=Path,
        default=None,
        help="CacheBlend-style JSON (MuSiQue): passages form the conversation's document and new chunks",
    )
    conversation.add_argument(
        "--sizes",
        type=int,
        nargs="+",
        default=[2000, 6000],
        help="turn 1's document size in tokens (default: 2000 6000)",
    )
    conversation.add_argument("--follow-ups", type=int, default=3, help="follow-ups per size, each one new chunk")
    conversation.add_argument("--strategy", default="probe", help="fusion strategy spec (default: probe)")
    conversation.add_argument("--max-new-tokens", type=int, default=8)
    conversation.add_argument(
        "--fuse-only",
        action="store_true",
        help="time only the fuse stage over a synthetic cached conversation, copying the "
        "conversation's rows against fusing in place (no ingestion, no turn 1)",
    )
    conversation.add_argument(
        "--fidelity",
        nargs="+",
        default=None,
        metavar="STRATEGY",
        help="instead of timing turns: fuse one new chunk after an exactly prefilled conversation of each "
        "size with these strategy specs and compare each with the exact answer (first-token and "
        "teacher-forced KL and agreement, fuse time); needs --data",
    )
    conversation.add_argument(
        "--examples",
        type=_example_range,
        default=(0, 10),
        metavar="START:END",
        help="with --fidelity: the dataset's examples START..END-1 (default 0:10)",
    )
    conversation.add_argument("--json", type=Path, default=None, help="write all figures to this file")

    sparse = kinds.add_parser("sparse", help="sparse decode selectors vs dense: recall, answer F1, ms/token, memory")
    bench_sparse.configure(sparse)

    decode = kinds.add_parser("decode", help="dense decode ms/token, batched tokens/s and quality per weight/KV format")
    bench_decode.configure(decode)

    kernels = kinds.add_parser(
        "kernels",
        help="attention kernels (Triton, FlashInfer, torch) at a real model's geometry "
        "vs the torch reference, and a random-weight decode step",
    )
    bench_kernels.configure(kernels)

    geometry = kinds.add_parser(
        "geometry",
        help="the engine at a real model's geometry, random weights: fused vs full prefill, "
        "decode ms/token beside its memory-bandwidth floor",
    )
    bench_geometry.configure(geometry)

    soak = kinds.add_parser(
        "soak",
        help="two replicas under mixed load through a Redis restart and a replica kill: "
        "errors, lost documents, TTFT and memory over time",
    )
    bench_soak.configure(soak)

    arrivals = kinds.add_parser(
        "arrivals",
        help="running answers' inter-token latency while ~6K-token pasted prompts arrive, chunks on Redis "
        "with added latency",
    )
    bench_arrivals.configure(arrivals)

    retrieval = kinds.add_parser(
        "retrieval",
        help="the retrieval index: search latency, recall vs exact, add/delete "
        "cost at N chunks; dense/bm25/hybrid recall on a dev set (--dev)",
    )
    bench_retrieval.configure(retrieval)

    ingest = kinds.add_parser(
        "ingest",
        help="ingestion tokens/s on dev documents, beside a llama-server's prompt processing of the same text (--peer)",
    )
    bench_ingest.configure(ingest)

    passages = kinds.add_parser(
        "passages",
        help="passages pasted into the prompt: fidelity against the full prefill, or --sustained hit rate over a pool",
    )
    bench_passages.configure(passages)

    eviction = kinds.add_parser(
        "eviction",
        help="the sustained passage workload replayed against a capped store, no model: hit rates per policy",
    )
    bench_eviction.configure(eviction)

    tenants = kinds.add_parser(
        "tenants",
        help="two tenants on a capped store: A's hit rate and TTFT while B pastes new passage sets, "
        "with and without per-tenant budgets",
    )
    bench_tenants.configure(tenants)

    vllm_connector = kinds.add_parser(
        "vllm-connector",
        help="vLLM with RagkvConnector against vLLM alone: TTFT, first-token KL, a repeated prompt token for token",
    )
    bench_vllm.configure(vllm_connector)


def run(args: argparse.Namespace) -> int:
    handlers = {
        "store": _run_store,
        "fusion": _run_fusion,
        "conversation": _run_conversation,
        "sparse": bench_sparse.run,
        "decode": bench_decode.run,
        "kernels": bench_kernels.run,
        "geometry": bench_geometry.run,
        "retrieval": bench_retrieval.run,
        "soak": bench_soak.run,
        "arrivals": bench_arrivals.run,
        "ingest": bench_ingest.run,
        "passages": bench_passages.run,
        "eviction": bench_eviction.run,
        "tenants": bench_tenants.run,
        "vllm-connector": bench_vllm.run,
    }
    results = handlers[args.bench](args)
    if args.json:
        _write_json(args.json, results)
        print(f"wrote {args.json}")
    return 0


def _run_store(args: argparse.Namespace) -> dict:
    import torch
    from transformers import AutoConfig

    from ragkv.bench.storage_bench import run_format_load_bench
    from ragkv.bench.store_bench import run_store_bench
    from ragkv.engine.kv_storage import KV_STORAGE_FORMATS
    from ragkv.engine.model_files import resolve_model_dir
    from ragkv.engine.model_spec import ModelSpec
    from ragkv.store.url import open_store

    args.formats = args.formats or list(KV_STORAGE_FORMATS)
    unknown = sorted(set(args.formats) - set(KV_STORAGE_FORMATS))
    if unknown:
        raise ValueError(f"unknown KV storage format(s) {unknown}; choose from {list(KV_STORAGE_FORMATS)}")
    spec = ModelSpec.from_hf_config(AutoConfig.from_pretrained(resolve_model_dir(args.model)))
    if args.data_dir:
        args.data_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="ragkv-bench-", dir=args.data_dir) as scratch:
        stores = {"lmdb": open_store(f"lmdb://{Path(scratch, 'lmdb').resolve()}")}
        if args.redis:
            stores["redis"] = open_store(args.redis)
        try:
            results = run_store_bench(
                stores,
                chunks=args.chunks,
                tokens_per_chunk=args.tokens_per_chunk,
                layers=spec.num_layers,
                kv_heads=spec.num_kv_heads,
                head_dim=spec.head_dim,
                dtype=torch.float16,
                tmp_dir=Path(scratch),
            )
        finally:
            for store in stores.values():
                store.close()
        results["formats"] = run_format_load_bench(
            spec, args.formats, chunks=min(args.chunks, 16), tokens_per_chunk=args.tokens_per_chunk, tmp_dir=scratch
        )
    print(json.dumps(results, indent=2))
    print(
        f"{'format':<10} {'bytes/token':>11} {'read ms':>8} {'place ms':>8} {'load ms':>8} "
        f"{'best load ms':>12}  (per chunk)"
    )
    for name, row in results["formats"].items():
        print(
            f"{name:<10} {row['bytes_per_token']:>11,.0f} {row['read_ms_per_chunk']:>8.2f} "
            f"{row['place_ms_per_chunk']:>8.2f} {row['load_ms_per_chunk']:>8.2f} {row['best_load_ms_per_chunk']:>12.2f}"
        )
    if args.data is not None:
        results["fidelity"] = _run_format_fidelity(args)
    return results


def _run_format_fidelity(args: argparse.Namespace) -> dict:
    from ragkv.bench.datasets import load_examples
    from ragkv.bench.fusion_bench import parse_strategy
    from ragkv.bench.storage_bench import REFERENCE_FORMAT, run_format_fidelity_bench
    from ragkv.cli.config_args import config_from_args
    from ragkv.engine import Engine, EngineConfig

    examples = load_examples(args.data, args.limit, args.passages)
    strategies = [parse_strategy(spec, args.ratio) for spec in args.strategies]
    formats = [name for name in args.formats if name != REFERENCE_FORMAT]
    engine = Engine(config_from_args(EngineConfig, args))
    fidelity = run_format_fidelity_bench(
        engine,
        examples,
        formats,
        strategies,
        max_new_tokens=args.max_new_tokens,
        progress=lambda message: print(message, file=sys.stderr, flush=True),
    )
    print(
        f"{fidelity['examples']} examples x {fidelity['passages_per_example']:.0f} passages, "
        f"against {REFERENCE_FORMAT} chunks"
    )
    print(f"{'strategy':<24} {'format':<10} {'bytes/token':>11} {'KL':>8} {'KL max':>8} {'top1':>5} {'F1 vs f16':>9}")
    for label, per_format in fidelity["strategies"].items():
        for name, row in per_format.items():
            print(
                f"{label:<24} {name:<10} {row['bytes_per_token']:>11,.0f} {row['first_token_kl']:>8.4f} "
                f"{row['first_token_kl_max']:>8.4f} {row['top1_agreement']:>5.2f} {row['answer_f1_vs_float16']:>9.2f}"
            )
    return fidelity


def _run_fusion(args: argparse.Namespace) -> dict:
    from ragkv.app.runtime import Runtime
    from ragkv.bench.datasets import load_examples
    from ragkv.bench.fusion_bench import parse_variants, run_fusion_bench

    if args.examples is None:
        examples = load_examples(args.data, args.limit, args.passages)
    else:
        start, end = args.examples
        examples = load_examples(args.data, None, args.passages)[start:end]
        if not examples:
            raise ValueError(f"the dataset has no examples in {start}:{end}")
    variants = parse_variants(args.strategies)
    config = runtime_config(args, show_progress=False, context_neighbours=args.context_neighbours)
    with Runtime(config) as runtime:
        results = run_fusion_bench(
            runtime,
            examples,
            variants,
            max_new_tokens=args.max_new_tokens,
            weight_formats=args.weight_formats,
            progress=lambda message: print(message, file=sys.stderr, flush=True),
            checkpoint=lambda partial: _write_json(args.json, partial),
        )
    print(
        f"{results['examples']} examples, {results['passages_per_example']:.0f} passages, "
        f"{results['strategies']['full']['prompt_tokens']:.0f} prompt tokens on average, {results['dtype']}"
    )
    if args.examples is not None:
        results["example_range"] = list(args.examples)
    print(
        f"{'strategy':<40} {'TTFT s':>7} {'speedup':>7} {'KL':>6} {'KL p75':>6} {'top1':>5} {'TF agr':>6} "
        f"{'TF min':>6} {'TF KL':>6} {'agree':>5} {'gold':>5} {'recomp':>6}"
    )
    for label, row in results["strategies"].items():
        print(
            f"{label:<40} {row['ttft_median_s']:>7.2f} {row['speedup_total']:>7.2f} {row['first_token_kl']:>6.3f} "
            f"{row['first_token_kl_spread']['p75']:>6.3f} {row['top1_agreement']:>5.2f} "
            f"{row['teacher_forced_agreement']:>6.3f} {row['teacher_forced_agreement_spread']['min']:>6.3f} "
            f"{row['teacher_forced_kl']:>6.3f} {row['answer_agreement']:>5.2f} {row['gold_f1']:>5.2f} "
            f"{row['recomputed_share']:>6.3f}"
        )
    for label, row in results.get("weights", {}).items():
        print(
            f"{label:<40} {'':>7} {'':>7} {row['first_token_kl']:>6.3f} {'':>6} {row['top1_equal']:>5.2f} "
            f"{row['teacher_forced_agreement']:>6.3f} {'':>6} {row['teacher_forced_kl']:>6.3f} "
            f"{row['answer_agreement']:>5.2f}   (full prefill vs float32)"
        )
    print(
        "TTFT: median; speedup: total full TTFT / total strategy TTFT; TF: teacher-forced along full's greedy answer "
        "(agreement mean and worst example, mean KL); agree: free-running answer token-F1 vs full's answer; "
        "recomp: share of document tokens recomputed"
    )
    return results


def _run_conversation(args: argparse.Namespace) -> dict:
    from ragkv.app.runtime import Runtime
    from ragkv.bench.conversation_bench import build_cases, run_conversation_bench
    from ragkv.bench.datasets import load_examples
    from ragkv.fusion import FusionConfig

    fusion = FusionConfig(args.strategy)
    if args.fuse_only:
        from ragkv.bench.conversation_bench import run_fuse_stage_bench
        from ragkv.cli.config_args import config_from_args
        from ragkv.engine import Engine, EngineConfig

        engine = Engine(config_from_args(EngineConfig, args))
        return run_fuse_stage_bench(
            engine,
            args.sizes,
            strategy=args.strategy,
            progress=lambda message: print(message, file=sys.stderr, flush=True),
        )
    if args.data is None:
        raise ValueError("--data is required (or --fuse-only)")
    examples = load_examples(args.data)
    if args.fidelity:
        return _conversation_fidelity(args, examples)
    with Runtime(runtime_config(args, show_progress=False)) as runtime:
        cases = build_cases(examples, args.sizes, args.follow_ups, runtime.engine.tokenize)
        results = run_conversation_bench(
            runtime,
            cases,
            fusion=fusion,
            max_new_tokens=args.max_new_tokens,
            progress=lambda message: print(message, file=sys.stderr, flush=True),
        )
    print(
        f"{'context tokens':>14} {'prompt':>7} {'TTFT s':>7} {'fuse s':>7}  "
        f"(medians over follow-ups, {fusion.strategy})"
    )
    for size, row in results["sizes"].items():
        print(f"{size:>14} {row['prompt_tokens']:>7.0f} {row['ttft_median_s']:>7.3f} {row['fuse_median_s']:>7.3f}")
    return results


def _conversation_fidelity(args: argparse.Namespace, examples: list) -> dict:
    from ragkv.bench.followup_fidelity import run_followup_fidelity
    from ragkv.cli.bench_retrieval import machine_description
    from ragkv.cli.config_args import config_from_args
    from ragkv.engine import Engine, EngineConfig

    start, end = args.examples
    engine = Engine(config_from_args(EngineConfig, args))
    results = {
        "examples": [start, end],
        "max_new_tokens": args.max_new_tokens,
        "machine": machine_description(),
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "sizes": {},
    }
    print(f"{'context':>8} {'strategy':<32} {'KL mean':>8} {'median':>7} {'TF agr':>7} {'TF KL':>7} {'fuse s':>7}")
    for size in args.sizes:
        row = run_followup_fidelity(
            engine,
            examples[start:],
            args.fidelity,
            context_tokens=size,
            count=end - start,
            max_new_tokens=args.max_new_tokens,
            progress=lambda message: print(message, file=sys.stderr, flush=True),
        )
        results["sizes"][str(size)] = row
        for spec, figures in row["strategies"].items():
            print(
                f"{size:>8} {spec:<32} {figures['first_token_kl']:>8.4f} {figures['first_token_kl_median']:>7.4f} "
                f"{figures['teacher_forced_agreement']:>7.3f} {figures['teacher_forced_kl']:>7.4f} "
                f"{figures['fuse_median_s']:>7.3f}"
            )
    return results


def _example_range(text: str) -> tuple[int, int]:
    try:
        start, end = (int(part) for part in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected START:END (e.g. 50:70), got {text!r}") from None
    if not 0 <= start < end:
        raise argparse.ArgumentTypeError(f"expected 0 <= START < END, got {text!r}")
    return start, end


COMMAND = Command("bench", "benchmarks (store throughput, fusion quality and TTFT, sparse decode)", configure, run)


def _write_json(path: Path | None, results: dict) -> None:
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(results, indent=2))
