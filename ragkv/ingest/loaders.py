"""Reading documents from files. Plain text formats are read as they are; HTML has its
markup removed; PDF and DOCX go through ingest.formats (PDF keeps each page's span).
Anything else is refused with a message naming what is supported. Every check here runs
without the model, so a command can refuse a file before loading one."""

from __future__ import annotations

from dataclasses import dataclass
from html.parser import HTMLParser
from pathlib import Path

from ragkv.errors import InputError
from ragkv.ingest.formats import CONTAINER_FACTOR, CONTAINER_SUFFIXES, DOCX_SUFFIXES, PDF_SUFFIXES, docx_text, pdf_pages
from ragkv.ingest.validation import DEFAULT_MAX_DOCUMENT_BYTES, check_text, decode_document

TEXT_SUFFIXES = (".txt", ".text", ".md", ".markdown", ".rst", ".csv", ".tsv", ".log")
HTML_SUFFIXES = (".html", ".htm")
SUPPORTED_SUFFIXES = TEXT_SUFFIXES + HTML_SUFFIXES + CONTAINER_SUFFIXES
PAGE_SEPARATOR = "\n\n"


@dataclass(frozen=True)
class LoadedDocument:
    text: str
    pages: list[list[int]] | None = None
    """[char start, char end) of each page in `text` (page 1 first), for formats with
    pages (PDF); None otherwise."""


def join_pages(pages: list[str]) -> LoadedDocument:
    """One text from the pages, blank-line separated, with each page's span."""
    parts, spans, position = [], [], 0
    for page in pages:
        page = page.strip()
        if parts:
            position += len(PAGE_SEPARATOR)
        spans.append([position, position + len(page)])
        parts.append(page)
        position += len(page)
    return LoadedDocument(PAGE_SEPARATOR.join(parts), spans)


class _TextOfHTML(HTMLParser):
    _SKIPPED = {"script", "style", "head"}
    _BLOCKS = {"p", "div", "br", "li", "h1", "h2", "h3", "h4", "h5", "h6", "tr", "section", "article"}

    def __init__(self) -> None:
        super().__init__()
        self.parts: list[str] = []
        self._skip_depth = 0

    def handle_starttag(self, tag, attrs):
        if tag in self._SKIPPED:
            self._skip_depth += 1
        elif tag in self._BLOCKS:
            self.parts.append("\n")

    def handle_endtag(self, tag):
        if tag in self._SKIPPED and self._skip_depth:
            self._skip_depth -= 1

    def handle_data(self, data):
        if not self._skip_depth:
            self.parts.append(data)


def html_to_text(html: str) -> str:
    parser = _TextOfHTML()
    parser.feed(html)
    lines = (" ".join(line.split()) for line in "".join(parser.parts).splitlines())
    return "\n".join(line for line in lines if line)


def file_limit(name: str, max_bytes: int) -> int:
    """The largest file accepted for `name`'s format: PDF and Office files carry images
    and fonts besides their text."""
    return max_bytes * CONTAINER_FACTOR if Path(name).suffix.lower() in CONTAINER_SUFFIXES else max_bytes


def load_document(data: bytes, name: str, max_bytes: int = DEFAULT_MAX_DOCUMENT_BYTES) -> LoadedDocument:
    """Text (and page spans) of a document given as bytes; `name`'s suffix picks the format."""
    suffix = Path(name).suffix.lower()
    if suffix and suffix not in SUPPORTED_SUFFIXES:
        raise InputError(
            "unsupported_type", f"{name}: unsupported file type {suffix!r}; supported: {', '.join(SUPPORTED_SUFFIXES)}"
        )
    if suffix in CONTAINER_SUFFIXES:
        limit = file_limit(name, max_bytes)
        if len(data) > limit:
            raise InputError("too_large", f"{name}: {len(data)} bytes exceeds the limit of {limit} bytes")
        if suffix in PDF_SUFFIXES:
            loaded = join_pages(pdf_pages(data, name))
        else:
            assert suffix in DOCX_SUFFIXES
            loaded = LoadedDocument(docx_text(data, name))
        return LoadedDocument(check_text(loaded.text, name, max_bytes), loaded.pages)
    text = decode_document(data, name, max_bytes)
    if suffix in HTML_SUFFIXES:
        text = check_text(html_to_text(text), name, max_bytes)
    return LoadedDocument(text)


def document_text(data: bytes, name: str, max_bytes: int = DEFAULT_MAX_DOCUMENT_BYTES) -> str:
    """Text of a document given as bytes; `name`'s suffix picks the format."""
    return load_document(data, name, max_bytes).text


def load_path(path: Path, max_bytes: int = DEFAULT_MAX_DOCUMENT_BYTES) -> LoadedDocument:
    if not path.is_file():
        raise InputError("missing", f"{path}: no such file")
    size, limit = path.stat().st_size, file_limit(path.name, max_bytes)
    if size > limit:
        raise InputError("too_large", f"{path}: {size} bytes exceeds the limit of {limit} bytes")
    return load_document(path.read_bytes(), str(path), max_bytes)


def read_document(path: Path, max_bytes: int = DEFAULT_MAX_DOCUMENT_BYTES) -> str:
    return load_path(path, max_bytes).text


@dataclass(frozen=True)
class FoundFiles:
    files: list[Path]
    """Files named directly (read even if unsupported: the reader says why not), plus the
    supported files under named folders, sorted."""
    unsupported: list[Path]
    """Files under named folders whose type is not supported (not read); hidden files and
    folders (.git, .DS_Store) are not searched."""


def _hidden(relative: Path) -> bool:
    return any(part.startswith(".") for part in relative.parts)


def expand_paths(paths: list[Path]) -> FoundFiles:
    """The files to ingest from files and folders given on a command line."""
    files: list[Path] = []
    unsupported: list[Path] = []
    for path in paths:
        if path.is_dir():
            for found in sorted(p for p in path.rglob("*") if p.is_file() and not _hidden(p.relative_to(path))):
                (files if found.suffix.lower() in SUPPORTED_SUFFIXES else unsupported).append(found)
        else:
            files.append(path)
    return FoundFiles(files, unsupported)
