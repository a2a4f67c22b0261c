"""`ragkv --help` imports nothing heavy: the top-level parser lists the commands without
building their options, which is where torch, transformers and fastapi come in; and
`ragkv ingest` refuses unusable files before any of them is imported."""

from __future__ import annotations

import subprocess
import sys

HEAVY = ("torch", "transformers", "fastapi", "sentence_transformers", "uvicorn")

PROBE = f"""
import contextlib, io, sys
from ragkv.cli.main import main
with contextlib.redirect_stdout(io.StringIO()) as help_text:
    try:
        main(sys.argv[1:])
    except SystemExit:
        pass
print("HELP" if "calibrate" in help_text.getvalue() else "NO HELP")
print(sorted(name for name in {HEAVY!r} if name in sys.modules))
"""


def _imported_after(argv: list[str]) -> tuple[str, str]:
    # a fresh interpreter: this test process has imported torch already
    out = subprocess.run([sys.executable, "-c", PROBE, *argv], capture_output=True, text=True, check=True, timeout=120)
    help_line, modules = out.stdout.strip().splitlines()[-2:]
    return help_line, modules


def test_top_level_help_imports_no_heavy_library():
    assert _imported_after(["--help"]) == ("HELP", "[]")


def test_a_command_help_still_builds_its_options():
    # the reference: a command's own help builds its options, which import the engine
    _, modules = _imported_after(["ask", "--help"])
    assert "torch" in modules


def test_refusing_unusable_files_imports_no_model_library(tmp_path):
    """`ragkv ingest` on files it cannot use answers in about a second: the checks, the
    options and the refusal import neither torch nor transformers."""
    (tmp_path / "empty.txt").write_text("  \n")
    (tmp_path / "fake.pdf").write_bytes(b"not a pdf at all")
    (tmp_path / "photo.jpg").write_bytes(b"\xff\xd8\xff\xe0")
    _, modules = _imported_after(["ingest", str(tmp_path), "--no-progress"])
    assert modules == "[]"
