"""Options several commands share, and the runtime config they describe."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from ragkv.cli.config_args import add_config_options, config_from_args


def add_store_options(parser: argparse.ArgumentParser) -> None:
    """Where the data lives and whose it is."""
    group = parser.add_argument_group("store")
    group.add_argument("--data-dir", type=Path, default=None, help="data folder (default: $RAGKV_HOME or ~/.ragkv)")
    group.add_argument("--store", default=None, help="chunk store URL (default: lmdb://<data-dir>/db)")
    group.add_argument(
        "--registry",
        default=None,
        help="document registry URL, e.g. redis://HOST:6379/2 to share documents between hosts "
        "(default: $RAGKV_REGISTRY, else the data folder's LMDB)",
    )
    group.add_argument("--tenant", default="default", help="tenant whose documents are used (default: default)")
    group.add_argument(
        "--store-secret",
        default=None,
        help="deployment secret: chunk blobs carry a MAC keyed by it instead of a CRC-32 "
        "(default: $RAGKV_STORE_SECRET; prefer the variable, a flag shows in `ps`)",
    )
    from ragkv.app.storage_config import StorageConfig

    add_config_options(group, StorageConfig, skip=("store_url", "registry_url", "store_secret"))


def _store_secret(args: argparse.Namespace) -> str | None:
    return args.store_secret or os.environ.get("RAGKV_STORE_SECRET") or None


def add_engine_options(parser: argparse.ArgumentParser) -> None:
    from ragkv.engine.config import EngineConfig

    add_config_options(parser.add_argument_group("engine/model"), EngineConfig, skip=("system_prompt",))


def add_verbose_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-v", "--verbose", action="store_true", help="log what ragkv does")


def add_common_options(parser: argparse.ArgumentParser, *, engine: bool = True) -> None:
    """Store options, -v and (for commands that load the model) the engine options."""
    add_verbose_option(parser)
    add_store_options(parser)
    if engine:
        add_engine_options(parser)


def storage_config(args: argparse.Namespace):
    """Where the data is, for commands that do not load the model (imports no model code)."""
    from ragkv.app.storage_config import StorageConfig, default_data_dir

    return StorageConfig(
        data_dir=args.data_dir or default_data_dir(),
        store_url=args.store,
        store_secret=_store_secret(args),
        store_capacity=args.store_capacity,
        store_protected_share=args.store_protected_share,
        store_tenant_budget=args.store_tenant_budget,
        **_registry(args),
    )


def _registry(args: argparse.Namespace) -> dict:
    """registry_url only when given: otherwise the config's default ($RAGKV_REGISTRY) holds."""
    return {"registry_url": args.registry} if args.registry else {}


def runtime_config(args: argparse.Namespace, **ingest_overrides):
    from ragkv.app.runtime import RuntimeConfig
    from ragkv.app.storage_config import default_data_dir
    from ragkv.engine.config import EngineConfig
    from ragkv.ingest.pipeline import IngestConfig

    return RuntimeConfig(
        data_dir=args.data_dir or default_data_dir(),
        store_url=args.store,
        **_registry(args),
        store_secret=_store_secret(args),
        store_capacity=args.store_capacity,
        store_protected_share=args.store_protected_share,
        store_tenant_budget=args.store_tenant_budget,
        engine=config_from_args(EngineConfig, args),
        ingest=config_from_args(IngestConfig, args, **ingest_overrides),
    )


def client_config(args: argparse.Namespace):
    """The in-process engine client's config (ragkv.app.server.LocalClient) for `ask` and
    `ingest`: the runtime the flags describe; chat sessions in memory (the CLI has none)."""
    from ragkv.app.server.config import ServerConfig

    return ServerConfig(runtime=runtime_config(args, show_progress=False), session_store="memory")
