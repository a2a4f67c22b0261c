"""Checks that turn bad documents into clear errors before any work or write happens."""

from __future__ import annotations

from ragkv.errors import InputError

DEFAULT_MAX_DOCUMENT_BYTES = 16 * 1024 * 1024

# Text files carry tabs and newlines; other C0 controls in bulk mean binary data.
_ALLOWED_CONTROLS = {"\t", "\n", "\r", "\f"}


def decode_document(data: bytes, name: str, max_bytes: int = DEFAULT_MAX_DOCUMENT_BYTES) -> str:
    """Decode bytes as UTF-8 text or raise InputError saying exactly what is wrong."""
    if len(data) > max_bytes:
        raise InputError("too_large", f"{name}: {len(data)} bytes exceeds the limit of {max_bytes} bytes")
    if b"\x00" in data[:65536]:
        raise InputError("binary", f"{name}: looks like a binary file (contains NUL bytes); send text")
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as error:
        raise InputError(
            "not_utf8", f"{name}: not valid UTF-8 (bad byte at offset {error.start}); re-encode the file as UTF-8"
        ) from None
    return check_text(text, name, max_bytes)


def check_text(text: str, name: str, max_bytes: int = DEFAULT_MAX_DOCUMENT_BYTES) -> str:
    if not isinstance(text, str):
        raise InputError("not_text", f"{name}: expected text, got {type(text).__name__}")
    size = len(text.encode("utf-8", errors="surrogatepass"))
    if size > max_bytes:
        raise InputError("too_large", f"{name}: {size} bytes exceeds the limit of {max_bytes} bytes")
    if not text.strip():
        raise InputError("empty", f"{name}: the document is empty")
    sample = text[:65536]
    controls = sum(1 for ch in sample if ord(ch) < 32 and ch not in _ALLOWED_CONTROLS)
    if "\x00" in sample or controls > 0.01 * len(sample):
        raise InputError("binary", f"{name}: looks like binary data (control characters); send text")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise InputError("not_utf8", f"{name}: contains unpaired surrogates; not valid Unicode text") from None
    return text
