"""`ragkv store gc [--dry-run]`: remove chunk blobs that no document references.

Interrupted ingestions are settled at every start-up (the journal); gc also finds what
the journal could not reach (a store that was down) and the blobs of removed models.
Blobs of ingestions running now are spared. Every process writing to the store must
use this data folder's registry, or gc removes the blobs only they reference.
"""

from __future__ import annotations

import argparse
import json

from ragkv.cli.command import Command
from ragkv.cli.options import add_store_options, add_verbose_option, storage_config


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("action", choices=("gc",), help="gc: remove unreferenced chunk blobs")
    parser.add_argument("--dry-run", action="store_true", help="count what would be removed; remove nothing")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    add_verbose_option(parser)
    add_store_options(parser)


def run(args: argparse.Namespace) -> int:
    from dataclasses import asdict

    from ragkv.app.storage import Storage
    from ragkv.ingest.cleanup import collect_garbage

    with Storage(storage_config(args), create=False) as storage:
        report = collect_garbage(storage.registry, storage.store, storage.journal, dry_run=args.dry_run)
    if args.json:
        print(json.dumps({"object": "store.gc", "dry_run": args.dry_run, **asdict(report)}))
        return 0
    verb = "would remove" if args.dry_run else "removed"
    count = report.unreferenced if args.dry_run else report.removed
    print(
        f"{report.scanned} chunk blobs scanned, {report.unreferenced} unreferenced: {verb} {count} "
        f"({report.bytes / 2**20:.1f} MiB)"
    )
    return 0


COMMAND = Command(
    "store", "chunk store maintenance: `ragkv store gc` removes unreferenced blobs", configure, run, description=__doc__
)
