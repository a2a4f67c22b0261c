"""PDF and DOCX reading (files generated with fpdf2 and python-docx, tests/document_files.py, so the text
each page holds is known), and `ragkv ingest` refusing unusable files before the model
loads. No model runs in this file."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from document_files import PAGE_FACTS, docx_bytes, pdf_bytes, scanned_pdf_bytes

from ragkv.errors import InputError
from ragkv.ingest.formats import CONTAINER_FACTOR
from ragkv.ingest.loaders import load_document, load_path
from ragkv.ingest.registry import DocumentRecord


def test_pdf_pages_keep_their_spans_and_a_chunk_knows_its_page():
    pages = [(fact + " ") * 6 for fact in PAGE_FACTS]
    loaded = load_document(pdf_bytes(pages), "report.pdf")
    assert len(loaded.pages) == 3
    for (start, end), fact in zip(loaded.pages, PAGE_FACTS):
        page_text = " ".join(loaded.text[start:end].split())  # the PDF wraps lines
        assert page_text.count(fact) == 6 and not any(other in page_text for other in PAGE_FACTS if other != fact)
    record = DocumentRecord("d", "t", "report.pdf", "h", 1, 1, "fp", 0.0, [], pages=loaded.pages)
    for number, (start, end) in enumerate(loaded.pages, start=1):
        assert record.page_of(start) == number and record.page_of(end - 1) == number
        if number < 3:
            assert record.page_of(end) == number + 1  # the separator belongs to the next page
    assert DocumentRecord.from_json(record.to_json()) == record
    assert DocumentRecord("d", "t", "a.txt", "h", 1, 1, "fp", 0.0, []).page_of(5) is None


def test_a_chunk_that_crosses_pages_names_its_first_and_last_page():
    record = DocumentRecord("d", "t", "r.pdf", "h", 1, 1, "fp", 0.0, [], pages=[[0, 10], [12, 30], [32, 40]])
    assert record.page_span(0, 10) == (1, 1)  # page 1 alone
    assert record.page_span(0, 12) == (1, 1)  # up to the separator: still page 1
    assert record.page_span(0, 13) == (1, 2)  # one character of page 2
    assert record.page_span(5, 40) == (1, 3)
    assert record.page_span(10, 20) == (2, 2)  # from the separator: page 2
    assert record.page_span(33, 40) == (3, 3)
    assert DocumentRecord("d", "t", "a.txt", "h", 1, 1, "fp", 0.0, []).page_span(0, 5) == (None, None)


def test_docx_reads_paragraphs_and_tables_in_order():
    data = docx_bytes(PAGE_FACTS[:2], table=[["Ferry", "07:45"], ["Bus", "08:10"]])
    text = load_document(data, "notes.docx").text
    parts = (PAGE_FACTS[0], PAGE_FACTS[1], "Ferry | 07:45", "Bus | 08:10", "After the table.")
    order = [text.index(part) for part in parts]
    assert order == sorted(order)
    assert load_document(data, "notes.docx").pages is None


@pytest.mark.parametrize(
    "name, data, reason",
    [
        ("scan.pdf", scanned_pdf_bytes(), "no_text_layer"),
        ("broken.pdf", b"%PDF-1.4\n% nothing else", "unreadable"),
        ("fake.pdf", b"plain text, not a PDF", "unreadable"),
        ("broken.docx", b"PK\x03\x04 not a zip", "unreadable"),
        ("program.exe", b"MZ\x90\x00", "unsupported_type"),
        ("empty.txt", b"   \n", "empty"),
        ("latin1.txt", "caf\xe9".encode("latin-1"), "not_utf8"),
    ],
)
def test_unusable_files_are_refused_with_a_reason(name, data, reason):
    with pytest.raises(InputError) as refused:
        load_document(data, name)
    assert refused.value.reason == reason and name in str(refused.value)
    if reason == "no_text_layer":
        assert "OCR" in str(refused.value)


def test_a_docx_zip_without_a_document_is_unreadable():
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as archive:
        archive.writestr("hello.txt", "not word")
    with pytest.raises(InputError) as refused:
        load_document(out.getvalue(), "archive.docx")
    assert refused.value.reason == "unreadable"


def test_size_limits_apply_to_the_file_and_to_its_text(tmp_path):
    text_pdf = pdf_bytes([PAGE_FACTS[0] * 40])
    path = tmp_path / "big.pdf"
    path.write_bytes(text_pdf)
    limit = len(text_pdf) // CONTAINER_FACTOR - 1
    with pytest.raises(InputError, match="exceeds the limit") as refused:
        load_path(path, limit)
    assert refused.value.reason == "too_large"
    with pytest.raises(InputError, match="exceeds the limit"):  # the file fits, its text does not
        load_document(text_pdf, "big.pdf", max_bytes=len(PAGE_FACTS[0]) * 10)


def unusable_folder(root: Path) -> Path:
    folder = root / "inbox"
    folder.mkdir()
    (folder / "scan.pdf").write_bytes(scanned_pdf_bytes())
    (folder / "broken.docx").write_bytes(b"PK\x03\x04 not a zip")
    (folder / "empty.md").write_text("  \n")
    (folder / "latin1.txt").write_bytes("caf\xe9 cr\xe8me".encode("latin-1"))
    (folder / "photo.jpg").write_bytes(b"\xff\xd8\xff\xe0")
    return folder


def test_a_folder_of_unusable_files_is_refused_without_loading_the_model(tmp_path):
    folder = unusable_folder(tmp_path)
    # The probe runs the real command with the model's loaders replaced by tripwires.
    probe = (
        "import sys, runpy\n"
        "import ragkv.engine.core as core, ragkv.engine.model as model\n"
        "def tripwire(*args, **kwargs):\n    raise SystemExit('the model was loaded')\n"
        "core.Engine.__init__ = tripwire\nmodel.CausalLM.load = tripwire\n"
        f"sys.argv = ['ragkv', 'ingest', {str(folder)!r}, '--json', '--no-progress']\n"
        "try:\n    runpy.run_module('ragkv', run_name='__main__')\nexcept SystemExit as exit:\n"
        "    assert exit.code == 1, exit.code\n"
        "assert 'ragkv.app.runtime' not in sys.modules, 'runtime imported'\n"
    )
    env = {**os.environ, "RAGKV_HOME": str(tmp_path / "home"), "HF_HUB_OFFLINE": "1"}
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout)
    reasons = {Path(failure["path"]).name: failure["reason"] for failure in summary["failures"]}
    assert reasons == {
        "scan.pdf": "no_text_layer",
        "broken.docx": "unreadable",
        "empty.md": "empty",
        "latin1.txt": "not_utf8",
    }
    assert [Path(p).name for p in summary["unsupported"]] == ["photo.jpg"]
    assert summary["totals"]["ingested"] == 0 and summary["totals"]["failed"] == 4
    for name in reasons:
        assert f"refused {folder / name}" in result.stderr
    assert "the model was not loaded" in result.stderr and "Traceback" not in result.stderr


def test_the_plain_command_refuses_named_files_and_says_why(tmp_path):
    """`ragkv ingest report.pdf notes.docx` as a user types it, with both files unusable."""
    folder = unusable_folder(tmp_path)
    env = {**os.environ, "RAGKV_HOME": str(tmp_path / "home"), "HF_HUB_OFFLINE": "1"}
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "ragkv",
            "ingest",
            str(folder / "scan.pdf"),
            str(folder / "broken.docx"),
            "--no-progress",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert result.returncode == 1 and "2 file(s) refused (the model was not loaded)" in result.stderr, result.stderr
    assert "no text layer" in result.stderr and "not a readable DOCX file" in result.stderr
    assert "0 of 2 files ingested, 2 failed" in result.stdout and "Traceback" not in result.stderr
    assert not (tmp_path / "home").exists()  # nothing was created either
