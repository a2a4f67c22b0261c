"""Text of PDF and Word files, through maintained libraries (imported only when such a
file comes): pypdf for PDF, page by page so citations can name the page; python-docx
for DOCX, paragraphs and tables in document order. Chosen by measurement against
pypdfium2, pdfplumber and markitdown (ARCHITECTURE.md).

A container's bytes include images and fonts, so the file may be `CONTAINER_FACTOR`
times the text limit; the text extracted from it must still fit the limit."""

from __future__ import annotations

import io
import logging

from ragkv.errors import InputError

log = logging.getLogger("ragkv.ingest")

PDF_SUFFIXES = (".pdf",)
DOCX_SUFFIXES = (".docx",)
CONTAINER_SUFFIXES = PDF_SUFFIXES + DOCX_SUFFIXES
CONTAINER_FACTOR = 8


def _unreadable(name: str, kind: str, error: Exception) -> InputError:
    return InputError("unreadable", f"{name}: not a readable {kind} file ({type(error).__name__}: {error})")


def pdf_pages(data: bytes, name: str) -> list[str]:
    """The text of each page of a PDF, in page order. A PDF whose pages carry no text
    (scanned images) is refused: it needs OCR first."""
    import pypdf

    if not data.startswith(b"%PDF") and b"%PDF" not in data[:1024]:
        raise InputError("unreadable", f"{name}: not a PDF file (no %PDF header)")
    logging.getLogger("pypdf").setLevel(logging.ERROR)  # its warnings about odd fonts would flood the log
    try:
        reader = pypdf.PdfReader(io.BytesIO(data))
        if reader.is_encrypted and not reader.decrypt(""):
            raise InputError("encrypted", f"{name}: the PDF is password-protected; send an unprotected copy")
        pages = [page.extract_text() or "" for page in reader.pages]
    except InputError:
        raise
    except Exception as error:  # a damaged file fails in many ways inside the parser: all mean "unreadable"
        raise _unreadable(name, "PDF", error) from None
    if not pages:
        raise InputError("empty", f"{name}: the PDF has no pages")
    if not any(page.strip() for page in pages):
        raise InputError(
            "no_text_layer",
            f"{name}: the PDF has no text layer ({len(pages)} page(s) of images, e.g. "
            "a scan); run OCR on it first (for example ocrmypdf) and ingest the result",
        )
    return pages


def docx_text(data: bytes, name: str) -> str:
    """The paragraphs and table rows of a Word document, in document order."""
    import docx
    from docx.table import Table

    try:
        document = docx.Document(io.BytesIO(data))
        lines = []
        for block in document.iter_inner_content():
            if isinstance(block, Table):
                for row in block.rows:
                    cells = [cell.text.strip() for cell in row.cells]
                    lines.append(" | ".join(dict.fromkeys(cell for cell in cells if cell)))  # merged cells repeat
            else:
                lines.append(block.text)
    except Exception as error:  # a zip that is no Word document: zipfile/lxml errors of many kinds
        raise _unreadable(name, "DOCX", error) from None
    return "\n".join(lines)
