"""`ragkv calibrate [PATH...]`: build the A2ATS codebook of the model (sparse decode)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ragkv.cli.command import Command
from ragkv.cli.config_args import add_config_options, config_from_args
from ragkv.cli.options import add_common_options, runtime_config


def _progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def configure(calibrate: argparse.ArgumentParser) -> None:
    from ragkv.sparse.calibrate import CalibrationConfig

    calibrate.add_argument("paths", nargs="*", type=Path, help="calibration files or folders")
    calibrate.add_argument("--from-store", action="store_true",
                           help="also calibrate on the tenant's ingested documents (the default when no paths are given)")
    calibrate.add_argument("--no-backfill", action="store_true",
                           help="do not add codes to the tenant's chunks already in the store")
    add_config_options(calibrate.add_argument_group("calibration"), CalibrationConfig)
    add_common_options(calibrate)


def run(args: argparse.Namespace) -> int:
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
            texts += [runtime.registry.text(args.tenant, record.doc_id) for record in runtime.registry.list(args.tenant)]
        if not texts:
            raise ValueError("nothing to calibrate on: give files, or ingest documents first")
        engine = runtime.engine
        codebook = calibrate(engine.model, engine.tokenize, texts, engine.chunk_prefix_ids, config, _progress)
        save_codebook(runtime.env, engine.fingerprint, codebook)
        engine.codebook = codebook
        updated = 0 if args.no_backfill else backfill_codes(runtime, args.tenant)
    print(f"codebook {codebook.id}: {codebook.size} centroids x {codebook.shape[0]} layers x {codebook.shape[1]} KV heads, "
          f"b={codebook.offset}, {codebook.info['tokens']} tokens in {codebook.info['seconds']} s; "
          f"stored for model {engine.fingerprint}; codes added to {updated} stored chunk(s)")
    return 0


def backfill_codes(runtime, tenant: str) -> int:
    """Give the tenant's stored chunks codes under the engine's codebook (stale ones replaced)."""
    import torch

    engine, store, codebook = runtime.engine, runtime.store, runtime.engine.codebook
    done: set[str] = set()
    updated = 0
    for record in runtime.registry.list(tenant):
        for chunk in record.chunks:
            if chunk.chunk_hash in done:
                continue
            done.add(chunk.chunk_hash)
            key = runtime.rag.chunk_key(chunk.chunk_hash)
            tensors = store.get(key)
            if tensors is None or codebook.codes_of(tensors) is not None:
                continue
            fresh = dict(tensors)
            fresh.update(codebook.chunk_tensors(engine.kv_format.dense_keys(tensors, torch.float32)))
            store.put(key, fresh)
            updated += 1
    return updated


COMMAND = Command("calibrate", "build the A2ATS codebook of the model from text (sparse decode)", configure, run)
