"""PDF and DOCX files made for the tests (fpdf2, python-docx), so the text each page holds
is known."""

from __future__ import annotations

import io

import docx
from fpdf import FPDF

PAGE_FACTS = [
    "The lighthouse keeper logged 41 storms in 1902.",
    "The orchard's oldest tree is a Bramley planted in 1871.",
    "The ferry to Inish More leaves at 07:45 on weekdays.",
]


def pdf_bytes(pages: list[str]) -> bytes:
    pdf = FPDF()
    pdf.set_font("Helvetica", size=11)
    for text in pages:
        pdf.add_page()
        pdf.multi_cell(0, 7, text)
    return bytes(pdf.output())


def scanned_pdf_bytes() -> bytes:
    """Pages that carry only drawings: what a scan without OCR looks like to a text reader."""
    pdf = FPDF()
    for _ in range(2):
        pdf.add_page()
        pdf.rect(20, 20, 120, 160, style="F")
    return bytes(pdf.output())


def docx_bytes(paragraphs: list[str], table: list[list[str]] | None = None) -> bytes:
    document = docx.Document()
    for paragraph in paragraphs:
        document.add_paragraph(paragraph)
    if table:
        grid = document.add_table(rows=len(table), cols=len(table[0]))
        for r, row in enumerate(table):
            for c, value in enumerate(row):
                grid.cell(r, c).text = value
    document.add_paragraph("After the table.")
    out = io.BytesIO()
    document.save(out)
    return out.getvalue()
