"""`ragkv ingest PATH...`: precompute and store the chunk KV of files and folders.

One progress bar for the whole run (ETA from the bytes still to read), a line per file,
and a final total: files, tokens, chunks computed and reused, bytes stored, failures and
the unsupported files found in folders. `--json` prints all of it as one JSON object.
A store that cannot take a write stops the run (exit 3); files that cannot be read are
failures (exit 1) and the rest are still ingested.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from ragkv.cli.command import Command
from ragkv.cli.options import add_common_options, runtime_config


def configure(parser: argparse.ArgumentParser) -> None:
    from ragkv.cli.config_args import add_config_options
    from ragkv.ingest.pipeline import IngestConfig

    parser.add_argument("paths", nargs="+", type=Path, help="files, or folders searched recursively")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
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
            "files": len(self.documents) + len(self.failures), "ingested": len(self.documents),
            "already_present": sum(document["duplicate_of_existing"] for document in self.documents),
            "failed": len(self.failures), "unsupported": len(self.unsupported), "tokens": total("tokens"),
            "chunks": total("chunks"), "computed_chunks": total("computed_chunks"),
            "reused_chunks": total("reused_chunks"), "stored_bytes": total("stored_bytes"),
            "stored_tokens": total("stored_tokens"),
            "bytes_per_token": round(total("stored_bytes") / total("stored_tokens"), 1) if total("stored_tokens") else 0.0,
            "seconds": round(time.perf_counter() - self.started, 3),
        }

    def to_dict(self) -> dict:
        return {"object": "ingestion", "documents": self.documents, "failures": self.failures,
                "unsupported": self.unsupported, "totals": self.totals()}

    def total_line(self) -> str:
        t = self.totals()
        present = f" ({t['already_present']} already present)" if t["already_present"] else ""
        return (f"total: {t['ingested']} of {t['files']} files ingested{present}, {t['failed']} failed, "
                f"{t['unsupported']} unsupported skipped; {t['tokens']} tokens, {t['chunks']} chunks "
                f"({t['computed_chunks']} computed, {t['reused_chunks']} reused), "
                f"{t['stored_bytes'] / 2**20:.1f} MiB stored ({t['bytes_per_token']:,.0f} bytes/token), {t['seconds']:.1f} s")


class Progress:
    """One bar over the bytes of all files, advanced chunk by chunk inside each file."""

    def __init__(self, paths: list[Path], enabled: bool):
        from tqdm import tqdm

        sizes = [path.stat().st_size if path.is_file() else 0 for path in paths]
        self.bar = tqdm(total=sum(sizes), unit="B", unit_scale=True, desc="ingest", disable=not enabled,
                        file=sys.stderr, dynamic_ncols=True)
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


def run(args: argparse.Namespace) -> int:
    from ragkv.app.runtime import Runtime
    from ragkv.ingest.errors import InputError
    from ragkv.ingest.loaders import expand_paths, read_document

    found = expand_paths(args.paths)
    summary = Summary(unsupported=[str(path) for path in found.unsupported])
    if not found.files:
        raise InputError("missing", "no supported files found in the given paths"
                         + (f" ({len(found.unsupported)} unsupported)" if found.unsupported else ""))
    config = runtime_config(args, show_progress=False)
    progress = Progress(found.files, enabled=not args.no_progress)
    try:
        for path in found.unsupported:
            progress.write(f"skipped {path}: unsupported file type")
        with Runtime(config) as runtime:
            for path in found.files:
                size = path.stat().st_size if path.is_file() else 0
                on_chunks = progress.start_file(path, size)
                try:
                    result = runtime.ingestor.ingest_text(read_document(path), str(path), tenant=args.tenant,
                                                          progress=on_chunks)
                except InputError as error:
                    summary.failures.append({"path": str(path), "reason": error.reason, "error": str(error)})
                    progress.write(f"failed {path}: {error}")
                    continue
                finally:
                    progress.end_file(size)
                document = _document(path, result)
                summary.documents.append(document)
                if not args.json:
                    progress.write(_document_line(document), file=sys.stdout)
    finally:
        progress.close()
    if args.json:
        print(json.dumps(summary.to_dict(), indent=2))
    else:
        print(summary.total_line())
    return 1 if summary.failures else 0


def _document(path: Path, result) -> dict:
    return {"id": result.doc_id, "path": str(path), "tokens": result.tokens, "chunks": result.chunks,
            "computed_chunks": result.computed_chunks, "reused_chunks": result.reused_chunks,
            "stored_bytes": result.stored_bytes, "stored_tokens": result.stored_tokens,
            "bytes_per_token": round(result.bytes_per_token, 1), "seconds": round(result.seconds, 3),
            "duplicate_of_existing": result.duplicate_of_existing}


def _document_line(document: dict) -> str:
    note = " (identical text already ingested)" if document["duplicate_of_existing"] else ""
    rate = document["tokens"] / document["seconds"] if document["seconds"] else 0.0
    return (f"{document['id']}  {document['path']}  {document['tokens']} tokens, {document['chunks']} chunks "
            f"({document['computed_chunks']} computed, {document['reused_chunks']} reused), "
            f"{document['stored_bytes'] / 2**20:.1f} MiB stored ({document['bytes_per_token']:,.0f} bytes/token), "
            f"{rate:.0f} tokens/s{note}")


COMMAND = Command("ingest", "ingest files or folders (.txt, .md, .rst, .csv, .html, ...)", configure, run,
                  description=__doc__)
