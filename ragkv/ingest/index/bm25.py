"""One tenant's BM25 index: SQLite FTS5 (it ships with Python, is incremental and lives in
one file on disk), so a passage can be found by an exact name or number the embedder blurs.

Tables: `chunks` (FTS5: the chunk texts, porter-stemmed), `rows` (chunk rowid -> doc_id,
chunk index: a document's rows are removed without scanning the FTS table) and `state`
(the registry generation the index holds and whose registry it follows). A change is one
transaction that re-checks the generation inside it, so processes sharing the file apply
each change once.
"""

from __future__ import annotations

import re
import sqlite3
import threading
from pathlib import Path

_WORD = re.compile(r"\w+", re.UNICODE)
MAX_QUERY_TERMS = 64

_SCHEMA = """
CREATE VIRTUAL TABLE IF NOT EXISTS chunks USING fts5(text, tokenize = 'porter unicode61');
CREATE TABLE IF NOT EXISTS rows (id INTEGER PRIMARY KEY, doc_id TEXT NOT NULL, chunk INTEGER NOT NULL);
CREATE INDEX IF NOT EXISTS rows_by_doc ON rows (doc_id);
CREATE TABLE IF NOT EXISTS state (key TEXT PRIMARY KEY, value TEXT NOT NULL);
"""


def match_expression(text: str) -> str | None:
    """An FTS5 query of the text's words, any of them (quoted: user text is never syntax)."""
    terms = list(dict.fromkeys(word.lower() for word in _WORD.findall(text)))[:MAX_QUERY_TERMS]
    return " OR ".join(f'"{term}"' for term in terms) or None


class Bm25Index:
    def __init__(self, path: Path | None, identity: str):
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(
            ":memory:" if path is None else str(path), check_same_thread=False, isolation_level=None, timeout=30.0
        )
        self._lock = threading.Lock()
        with self._lock:
            if path is not None:
                self._db.execute("PRAGMA journal_mode = WAL")
            self._db.executescript(_SCHEMA)
            if self._state("identity") not in (None, identity):
                # Another registry's index: start over.
                self._db.executescript(
                    "BEGIN IMMEDIATE; DELETE FROM chunks; DELETE FROM rows; DELETE FROM state; COMMIT;"
                )
            self._db.execute("INSERT OR IGNORE INTO state VALUES ('identity', ?)", (identity,))
            self._db.execute("INSERT OR IGNORE INTO state VALUES ('generation', '-1')")

    def _state(self, key: str) -> str | None:
        row = self._db.execute("SELECT value FROM state WHERE key = ?", (key,)).fetchone()
        return row[0] if row else None

    @property
    def generation(self) -> int:
        """The registry generation the index holds; -1: never built."""
        with self._lock:
            return int(self._state("generation") or -1)

    def apply(self, generation: int, removed: list[str], added: list[tuple[str, list[str]]]) -> None:
        """Remove `removed` documents' rows, add (doc_id, chunk texts) documents, and record
        `generation`; nothing when another process already brought the index that far."""
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                if int(self._state("generation") or -1) >= generation:
                    self._db.execute("ROLLBACK")
                    return
                self._write(removed, added, generation)
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise

    def rebuild(self, generation: int, documents: list[tuple[str, list[str]]]) -> None:
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                self._db.execute("DELETE FROM chunks")
                self._db.execute("DELETE FROM rows")
                self._write([], documents, generation)
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise

    def _write(self, removed: list[str], added: list[tuple[str, list[str]]], generation: int) -> None:
        db = self._db
        for doc_id in dict.fromkeys([*removed, *(doc for doc, _ in added)]):
            ids = [(row,) for (row,) in db.execute("SELECT id FROM rows WHERE doc_id = ?", (doc_id,))]
            db.executemany("DELETE FROM chunks WHERE rowid = ?", ids)
            db.execute("DELETE FROM rows WHERE doc_id = ?", (doc_id,))
        for doc_id, texts in added:
            for chunk, text in enumerate(texts):
                row = db.execute("INSERT INTO rows (doc_id, chunk) VALUES (?, ?)", (doc_id, chunk)).lastrowid
                db.execute("INSERT INTO chunks (rowid, text) VALUES (?, ?)", (row, text))
        db.execute("UPDATE state SET value = ? WHERE key = 'generation'", (str(generation),))

    def search(self, text: str, top_k: int, allowed: set[str] | None = None) -> list[tuple[str, int, float]]:
        """(doc_id, chunk, score) of the top_k chunks by BM25 (higher is better), only of
        `allowed` documents when given (inside the query, so k come back when k match)."""
        expression = match_expression(text)
        if expression is None or top_k < 1 or (allowed is not None and not allowed):
            return []
        sql = (
            "SELECT rows.doc_id, rows.chunk, bm25(chunks) AS rank FROM chunks JOIN rows ON rows.id = chunks.rowid "
            "WHERE chunks MATCH ?"
        )
        with self._lock:
            if allowed is not None:
                self._db.execute("CREATE TEMP TABLE IF NOT EXISTS allowed (doc_id TEXT PRIMARY KEY)")
                self._db.execute("DELETE FROM allowed")
                self._db.executemany("INSERT OR IGNORE INTO allowed VALUES (?)", [(doc,) for doc in allowed])
                sql += " AND rows.doc_id IN (SELECT doc_id FROM allowed)"
            found = self._db.execute(
                sql + " ORDER BY rank, rows.doc_id, rows.chunk LIMIT ?", (expression, top_k)
            ).fetchall()
        return [(doc_id, int(chunk), -float(rank)) for doc_id, chunk, rank in found]

    def close(self) -> None:
        with self._lock:
            self._db.close()
