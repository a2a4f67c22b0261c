"""`ragkv ingest PATH...`: precompute and store the chunk KV of files and folders.

Every file is read and checked (type, size, encoding, empty, a PDF without a text layer)
before the model loads: files that cannot be used are refused in a second, and when none
is usable the model is never loaded. Then one progress bar for the whole run (ETA from the
bytes still to read), a line per file, and a final total: files, tokens, chunks computed
and reused, tokens/s, bytes stored, failures and the unsupported files found in folders.
`--json` prints all of it as one JSON object. A store that cannot take a write stops the
run (exit 3); refused files are failures (exit 1) and the rest are still ingested.

A file whose name (its path as given) the tenant already has replaces that document: the
id stays, the old chunks leave retrieval when the new ones enter, unchanged chunks keep
their KV. `--no-replace` adds it as another document instead.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from ragkv.cli.command import Command
from ragkv.cli.options import add_common_options, client_config


def configure(parser: argparse.ArgumentParser) -> None:
    from ragkv.cli.config_args import add_config_options
    from ragkv.ingest.config import IngestConfig

    parser.add_argument("paths", nargs="+", type=Path, help="files, or folders searched recursively")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument(
        "--no-replace",
        action="store_true",
        help="add a file whose name the tenant has as another document (default: replace that one)",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON summary (per file and totals) on stdout")
    add_config_options(parser.add_argument_group("ingestion"), IngestConfig, skip=("show_progress",))
    add_common_options(parser)


@dataclass
class Summary:
    documents: list[dict] = field(default_factory=list)
    failures: list[dict] = field(default_factory=list)
    unsupported: list[str] = field(default_factory=list)
    started: float = field(default_factory=time.perf_counter)

    def _sum(self, name: str) -> int:
        return sum(document[name] for document in self.documents)

    def totals(self) -> dict:
        total = self._sum
        return {
            "files": len(self.documents) + len(self.failures),
            "ingested": len(self.documents),
            "already_present": sum(document["duplicate_of_existing"] for document in self.documents),
            "failed": len(self.failures),
            "unsupported": len(self.unsupported),
            "tokens": total("tokens"),
            "chunks": total("chunks"),
            "computed_chunks": total("computed_chunks"),
            "reused_chunks": total("reused_chunks"),
            "stored_bytes": total("stored_bytes"),
            "stored_tokens": total("stored_tokens"),
            "replaced": sum(d["replaced"] for d in self.documents),
            "encode_seconds": round(sum(d["encode_seconds"] for d in self.documents), 3),
            "encode_tokens_per_second": self._encode_rate(),
            "bytes_per_token": round(total("stored_bytes") / total("stored_tokens"), 1)
            if total("stored_tokens")
            else 0.0,
            "seconds": round(time.perf_counter() - self.started, 3),
        }

    def _encode_rate(self) -> float:
        seconds = sum(d["encode_seconds"] for d in self.documents)
        return round(self._sum("stored_tokens") / seconds, 1) if seconds else 0.0

    def to_dict(self) -> dict:
        return {
            "object": "ingestion",
            "documents": self.documents,
            "failures": self.failures,
            "unsupported": self.unsupported,
            "totals": self.totals(),
        }

    def total_line(self) -> str:
        t = self.totals()
        present = f" ({t['already_present']} already present)" if t["already_present"] else ""
        present += f" ({t['replaced']} replaced)" if t["replaced"] else ""
        rate = f", {t['encode_tokens_per_second']:,.0f} tokens/s encoded" if t["encode_seconds"] else ""
        return (
            f"total: {t['ingested']} of {t['files']} files ingested{present}, {t['failed']} failed, "
            f"{t['unsupported']} unsupported skipped; {t['tokens']} tokens, {t['chunks']} chunks "
            f"({t['computed_chunks']} computed, {t['reused_chunks']} reused{rate}), "
            f"{t['stored_bytes'] / 2**20:.1f} MiB stored ({t['bytes_per_token']:,.0f} bytes/token), "
            f"{t['seconds']:.1f} s"
        )


class Progress:
    """One bar over the bytes of all files, advanced chunk by chunk inside each file."""

    def __init__(self, paths: list[Path], enabled: bool):
        from tqdm import tqdm

        sizes = [path.stat().st_size if path.is_file() else 0 for path in paths]
        self.bar = tqdm(
            total=sum(sizes),
            unit="B",
            unit_scale=True,
            desc="ingest",
            disable=not enabled,
            file=sys.stderr,
            dynamic_ncols=True,
        )
        self.done = 0

    def start_file(self, path: Path, size: int):
        self.bar.set_postfix_str(path.name, refresh=False)
        base = self.done

        def on_chunks(done: int, total: int) -> None:
            self.bar.update(base + size * done // max(total, 1) - self.bar.n)

        return on_chunks

    def end_file(self, size: int) -> None:
        self.done += size
        self.bar.update(self.done - self.bar.n)

    def write(self, line: str, file=sys.stderr) -> None:
        """A line above the bar (which is redrawn below it)."""
        if self.bar.disable:
            print(line, file=file, flush=True)
        else:
            self.bar.write(line, file=file)

    def close(self) -> None:
        self.bar.close()


_KEPT_TEXT_BYTES = 256 * 2**20
"""Texts read during the checks are kept for ingestion up to this total; files past it are
read again when their turn comes (a large folder does not sit in memory)."""


@dataclass
class Checked:
    path: Path
    size: int
    document: object | None
    """The LoadedDocument read during the checks, or None to read it again."""


def check_files(files: list[Path], max_bytes: int, summary: Summary, write) -> list[Checked]:
    """Read and check every file without the model; refusals go into `summary`."""
    from ragkv.errors import InputError
    from ragkv.ingest.loaders import load_path

    usable, kept = [], 0
    for path in files:
        try:
            document = load_path(path, max_bytes)
        except InputError as error:
            summary.failures.append({"path": str(path), "reason": error.reason, "error": str(error)})
            write(f"refused {path}: {error}")
            continue
        size = len(document.text)
        kept += size
        usable.append(Checked(path, path.stat().st_size, document if kept <= _KEPT_TEXT_BYTES else None))
    return usable


def run(args: argparse.Namespace) -> int:
    from ragkv.cli.config_args import config_from_args
    from ragkv.errors import InputError
    from ragkv.ingest.config import IngestConfig
    from ragkv.ingest.loaders import expand_paths

    found = expand_paths(args.paths)
    summary = Summary(unsupported=[str(path) for path in found.unsupported])
    ingest_config = config_from_args(IngestConfig, args, show_progress=False)
    for path in found.unsupported:
        print(f"skipped {path}: unsupported file type", file=sys.stderr)
    usable = check_files(
        found.files, ingest_config.max_document_bytes, summary, lambda line: print(line, file=sys.stderr, flush=True)
    )
    if not usable:
        _print_summary(args, summary)
        if not found.files:
            raise InputError(
                "missing",
                "no supported files found in the given paths"
                + (f" ({len(found.unsupported)} unsupported)" if found.unsupported else ""),
            )
        print(f"nothing to ingest: {len(summary.failures)} file(s) refused (the model was not loaded)", file=sys.stderr)
        return 1
    _ingest(args, usable, summary)
    _print_summary(args, summary)
    return 1 if summary.failures else 0


def _ingest(args: argparse.Namespace, usable: list[Checked], summary: Summary) -> None:
    from ragkv.app.server.local import LocalClient
    from ragkv.errors import InputError
    from ragkv.ingest.loaders import load_path

    config = client_config(args)
    progress = Progress([checked.path for checked in usable], enabled=not args.no_progress)
    try:
        with LocalClient(config) as client:
            for checked in usable:
                path = checked.path
                on_chunks = progress.start_file(path, checked.size)
                try:
                    document = checked.document or load_path(path, config.runtime.ingest.max_document_bytes)
                    ingestion = client.new_document(
                        args.tenant,
                        document.text,
                        str(path),
                        pages=document.pages,
                        replace_same_name=not args.no_replace,
                    )
                    result = client.ingest(ingestion, progress=on_chunks).result
                except InputError as error:
                    summary.failures.append({"path": str(path), "reason": error.reason, "error": str(error)})
                    progress.write(f"failed {path}: {error}")
                    continue
                finally:
                    progress.end_file(checked.size)
                record = _document(path, result)
                summary.documents.append(record)
                if not args.json:
                    progress.write(_document_line(record), file=sys.stdout)
    finally:
        progress.close()


def _print_summary(args: argparse.Namespace, summary: Summary) -> None:
    if args.json:
        print(json.dumps(summary.to_dict(), indent=2))
    else:
        print(summary.total_line())


def _document(path: Path, result) -> dict:
    return {
        "id": result.doc_id,
        "path": str(path),
        "tokens": result.tokens,
        "chunks": result.chunks,
        "computed_chunks": result.computed_chunks,
        "reused_chunks": result.reused_chunks,
        "stored_bytes": result.stored_bytes,
        "stored_tokens": result.stored_tokens,
        "bytes_per_token": round(result.bytes_per_token, 1),
        "seconds": round(result.seconds, 3),
        "encode_seconds": round(result.timings.get("precompute", 0.0), 3),
        "encode_tokens_per_second": round(result.encode_tokens_per_second, 1),
        "duplicate_of_existing": result.duplicate_of_existing,
        "replaced": result.replaced,
    }


def _document_line(document: dict) -> str:
    note = " (identical text already ingested)" if document["duplicate_of_existing"] else ""
    note += " (replaced the previous version)" if document["replaced"] else ""
    rate = document["tokens"] / document["seconds"] if document["seconds"] else 0.0
    encoded = f", {document['encode_tokens_per_second']:,.0f} tokens/s encoded" if document["encode_seconds"] else ""
    return (
        f"{document['id']}  {document['path']}  {document['tokens']} tokens, {document['chunks']} chunks "
        f"({document['computed_chunks']} computed, {document['reused_chunks']} reused), "
        f"{document['stored_bytes'] / 2**20:.1f} MiB stored ({document['bytes_per_token']:,.0f} bytes/token), "
        f"{rate:.0f} tokens/s{encoded}{note}"
    )


COMMAND = Command(
    "ingest",
    "ingest files or folders (.txt, .md, .rst, .csv, .html, .pdf, .docx, ...)",
    configure,
    run,
    description=__doc__,
)
