"""`ragkv calibrate [codebook] [PATH...]`: build the A2ATS codebook of the model (sparse
decode); `ragkv calibrate fusion [PATH...]`: the smallest fusion recompute ratio within a
KL target of the full prefill on the user's documents (ragkv.app.fusion_calibration)."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

from ragkv.cli.command import Command
from ragkv.cli.config_args import add_config_options, config_from_args
from ragkv.cli.options import add_common_options, runtime_config


def _progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def configure(calibrate: argparse.ArgumentParser) -> None:
    from ragkv.sparse.calibrate import CalibrationConfig

    calibrate.add_argument(
        "paths",
        nargs="*",
        type=Path,
        help="[codebook|fusion] then calibration files or folders (codebook when not named)",
    )
    calibrate.add_argument(
        "--from-store",
        action="store_true",
        help="also calibrate on the tenant's ingested documents (the default when no paths are given)",
    )
    calibrate.add_argument(
        "--no-backfill", action="store_true", help="do not add codes to the tenant's chunks already in the store"
    )
    add_config_options(calibrate.add_argument_group("calibration"), CalibrationConfig)
    fusion = calibrate.add_argument_group("fusion calibration (ragkv calibrate fusion)")
    fusion.add_argument(
        "--target-kl",
        type=float,
        default=0.05,
        help="mean first-token and teacher-forced KL vs full prefill a ratio must meet (default: 0.05)",
    )
    fusion.add_argument("--ratios", type=float, nargs="+", default=None, help="ratios tried (default: 0.05 ... 1)")
    fusion.add_argument(
        "--refresh-ratios",
        type=float,
        nargs="+",
        default=None,
        help="answer-refresh shares tried with each ratio (the probe's refresh_ratio; default: 0 0.1 for the "
        "probe, 0 elsewhere); the cheapest point within the targets is kept",
    )
    fusion.add_argument(
        "--target-agreement",
        type=float,
        default=0.0,
        help="mean teacher-forced agreement with the full prefill's answer a point must meet too (default: 0)",
    )
    fusion.add_argument(
        "--questions",
        type=Path,
        default=None,
        help="a text file of questions, one per line (default: sentences of the documents)",
    )
    fusion.add_argument("--samples", type=int, default=8, help="questions measured (default: 8)")
    fusion.add_argument("--fusion-strategy", default="probe", help="strategy calibrated (default: probe)")
    add_common_options(calibrate)


def run(args: argparse.Namespace) -> int:
    kind = "codebook"
    if args.paths and str(args.paths[0]) in ("codebook", "fusion") and not args.paths[0].exists():
        kind = str(args.paths.pop(0))
    return run_fusion(args) if kind == "fusion" else run_codebook(args)


def run_fusion(args: argparse.Namespace) -> int:
    from ragkv.app.fusion_calibration import DEFAULT_RATIOS, FusionCalibrationConfig, calibrate_fusion, save_calibration
    from ragkv.app.runtime import Runtime
    from ragkv.ingest.loaders import expand_paths, read_document

    config = FusionCalibrationConfig(
        strategy=args.fusion_strategy,
        ratios=tuple(sorted(args.ratios or DEFAULT_RATIOS)),
        refresh_ratios=None if args.refresh_ratios is None else tuple(sorted(args.refresh_ratios)),
        target_kl=args.target_kl,
        min_agreement=args.target_agreement,
        samples=args.samples,
    )
    questions = None
    if args.questions is not None:
        if not args.questions.is_file():
            raise ValueError(f"questions file {args.questions} does not exist")
        questions = [line.strip() for line in args.questions.read_text(encoding="utf-8").splitlines() if line.strip()]
        if not questions:
            raise ValueError(f"{args.questions} holds no question")
    texts = [read_document(path) for path in expand_paths(args.paths).files] if args.paths else []
    if args.paths and not texts:
        raise ValueError("no supported files found in the given paths")
    with Runtime(runtime_config(args, show_progress=False)) as runtime:
        if not args.paths:
            texts = [runtime.registry.text(args.tenant, record.doc_id) for record in runtime.registry.list(args.tenant)]
        if not texts:
            raise ValueError("nothing to calibrate on: give files, or ingest documents first")
        engine = runtime.engine
        # chunks as this data folder's ingestion stores them (--context-neighbours)
        config = dataclasses.replace(config, context_chunks=runtime.config.ingest.context_neighbours)
        calibration = calibrate_fusion(engine, texts, config, questions, _progress)
        for point, figure in calibration.figures.items():
            print(
                f"ratio {point:>5}: first-token KL {figure['first_token_kl']:.4f}, teacher-forced KL "
                f"{figure['teacher_forced_kl']:.4f}, agreement {figure['teacher_forced_agreement']:.3f}"
            )
        targets = f"KL <= {config.target_kl}" + (
            f" and agreement >= {config.min_agreement}" if config.min_agreement else ""
        )
        if calibration.ratio is None:
            print(f"no setting tried meets {targets}; nothing stored", file=sys.stderr)
            return 1
        save_calibration(runtime.env, engine.fingerprint, calibration)
    refresh = f", answer refresh {calibration.refresh_ratio:g}" if calibration.refresh_ratio else ""
    print(
        f"{calibration.strategy}: ratio {calibration.ratio:g}{refresh} meets {targets} on "
        f"{calibration.samples} questions; stored for model {engine.fingerprint}"
    )
    return 0


def run_codebook(args: argparse.Namespace) -> int:
    from ragkv.app.codebooks import save_codebook
    from ragkv.app.runtime import Runtime
    from ragkv.ingest.loaders import expand_paths, read_document
    from ragkv.sparse.calibrate import CalibrationConfig, calibrate

    config = config_from_args(CalibrationConfig, args)
    texts = [read_document(path) for path in expand_paths(args.paths).files] if args.paths else []
    if args.paths and not texts:
        raise ValueError("no supported files found in the given paths")
    with Runtime(runtime_config(args, show_progress=False)) as runtime:
        if args.from_store or not args.paths:
            texts += [
                runtime.registry.text(args.tenant, record.doc_id) for record in runtime.registry.list(args.tenant)
            ]
        if not texts:
            raise ValueError("nothing to calibrate on: give files, or ingest documents first")
        engine = runtime.engine
        codebook = calibrate(engine.model, engine.tokenize, texts, engine.chunk_prefix_ids, config, _progress)
        save_codebook(runtime.env, engine.fingerprint, codebook)
        runtime.calibrated.codebook = codebook
        updated = 0 if args.no_backfill else backfill_codes(runtime, args.tenant)
    print(
        f"codebook {codebook.id}: {codebook.size} centroids x {codebook.shape[0]} layers "
        f"x {codebook.shape[1]} KV heads, "
        f"b={codebook.offset}, {codebook.info['tokens']} tokens in {codebook.info['seconds']} s; "
        f"stored for model {engine.fingerprint}; codes added to {updated} stored chunk(s)"
    )
    return 0


def backfill_codes(runtime, tenant: str) -> int:
    """Give the tenant's stored chunks codes under the model's codebook (stale ones replaced)."""
    import torch

    engine, store, codebook = runtime.engine, runtime.store, runtime.calibrated.codebook
    done: set[str] = set()
    updated = 0
    for record in runtime.registry.list(tenant):
        for chunk in record.chunks:
            if chunk.chunk_hash in done:
                continue
            done.add(chunk.chunk_hash)
            key = runtime.rag.chunk_key(record.tenant, chunk.chunk_hash)
            tensors = store.get(key)
            if tensors is None or codebook.codes_of(tensors) is not None:
                continue
            fresh = dict(tensors)
            fresh.update(codebook.chunk_tensors(engine.kv_format.dense_keys(tensors, torch.float32)))
            store.put(key, fresh)
            updated += 1
    return updated


COMMAND = Command(
    "calibrate",
    "calibrate for the model: the A2ATS codebook (sparse decode; `calibrate [codebook]`) "
    "or the fusion ratio (`calibrate fusion`)",
    configure,
    run,
)
