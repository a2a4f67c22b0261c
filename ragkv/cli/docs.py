"""`ragkv docs list | show ID | delete ID`: the tenant's documents (no model is loaded)."""

from __future__ import annotations

import argparse
import json

from ragkv.cli.command import Command
from ragkv.cli.options import add_common_options, storage_config


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("action", choices=("list", "show", "delete"))
    parser.add_argument("doc_id", nargs="?")
    parser.add_argument("--json", action="store_true", help="print JSON (the API's document fields)")
    add_common_options(parser, engine=False)


def run(args: argparse.Namespace) -> int:
    from ragkv.app.storage import Storage
    from ragkv.errors import InputError
    from ragkv.ingest.cleanup import delete_document

    if args.action in ("show", "delete") and not args.doc_id:
        raise InputError("missing_id", f"`ragkv docs {args.action}` needs a document id")
    if args.action == "list" and args.doc_id:
        raise InputError("extra_id", "`ragkv docs list` takes no document id")
    with Storage(storage_config(args), read_only=args.action != "delete", create=False) as storage:
        if args.action == "list":
            _print_list(storage.registry.list(args.tenant), args.json)
        elif args.action == "show":
            record = storage.registry.get(args.tenant, args.doc_id)
            print(json.dumps(record.detail(), indent=2))
        else:
            record = delete_document(storage.registry, storage.store, args.tenant, args.doc_id)
            if args.json:
                print(json.dumps({"id": record.doc_id, "object": "document", "deleted": True}))
            else:
                print(f"deleted {record.doc_id} ({record.name})")
    return 0


def _print_list(records, as_json: bool) -> None:
    if as_json:
        print(json.dumps({"object": "list", "data": [record.summary() for record in records]}, indent=2))
        return
    for record in records:
        print(f"{record.doc_id}  {record.num_tokens:>7} tokens  {len(record.chunks):>4} chunks  {record.name}")
    if not records:
        print("no documents")


COMMAND = Command("docs", "list, show or delete documents (no model is loaded)", configure, run)
