"""Passages inside any prompt: spans of token ids whose boundaries depend only on content.

A RAG application pastes retrieved passages into its prompt, joined by blank lines
(LangChain's and LlamaIndex's stuff prompts), wrapped in header or tag lines of its own
("Document [3]:", "[CONTEXT 2]:", "file_name: a.txt") or in inline tags one source per
line (Open WebUI's `<source id="2" name="...">text</source>`), in whatever order its
retriever returned them, before or after the question. The finder cuts a prompt's token
ids so a passage yields the same span, and so the same chunk key, wherever it stands:

    tokens ─► blocks: runs between blank lines (a token ending a line break after another,
              followed by a token that does not start with whitespace) or before a
              template token (<|im_start|>, <start_of_turn>)
           ─► markup: the tokens of an XML-like tag (`<source id="1">`, `</document>`), of a
              bracketed header line (`[CONTEXT 0]:`), of a label opening a line
              (`Context:`, `file_path:`) or of a JSON key (`{"text": "`) are left out and
              split their block, so one-line sources give one span each and a passage
              glued to the label before it is a span of its own
           ─► each piece: leading and trailing lines shorter than `edge_line_tokens` are
              left out (headers, tags, numbering that change with the passage's place)
           ─► what is left: a span when it holds at least `min_tokens`, cut into pieces of at
              most `max_tokens` where a rolling hash of the last `window` tokens says so
              (content-defined, so the same long passage is cut the same way anywhere)

Every decision reads only the piece's own tokens, never what precedes it, so a passage's
span does not change with its neighbours. A span always leaves a token after it: the
fusion computes the prompt's last rows itself.

Where the finder's edges still differ between two prompts (a first word merged with the
markup before it, chunks an application cut with overlap), anchors inside the spans find
the shared rows (`anchors.py`): the finder decides what is stored as a passage, the
anchors what of it another prompt reuses.

Why blank lines rather than a rolling hash over every token (BENCHMARKS.md, prompt
spans): the tokenizers of the supported families start a fresh token after a line break,
so a passage's tokens after a blank line are the same whatever came before it, while a
rolling hash over the whole prompt cuts a passage's first and last pieces together with
its neighbours' tokens, and those pieces miss whenever the order changes.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cached_property

import numpy as np

_HASH_MULTIPLIER = np.uint64(0x9E3779B97F4A7C15)
_MARKUP = re.compile(
    r"</?[A-Za-z][\w:.-]{0,40}(?:\s[^<>\n]{0,400}?)?/?>"  # an XML-like tag: <source id="1">, </doc>
    r"|^[ \t]*\[[^\]\n]{1,40}\][ \t]*:?[ \t]*$"  # a bracketed header line: [CONTEXT 0]:, [3]
    r"|^[ \t]*[A-Za-z_][\w \t-]{0,30}:(?=[ \t\n])"  # a label opening a line: Context:, file_path:
    r'|[{,][ \t]*"[A-Za-z_]\w{0,30}"[ \t]*:[ \t]*"?'  # a JSON key: {"text": "
    r'|"[ \t]*[}\]]+[ \t]*,?[ \t]*$',  # a JSON string closing its record: "}
    re.MULTILINE,
)
"""Markup that wraps passages rather than belongs to them; its tokens split their block
and are left out of every span."""


@dataclass(frozen=True)
class SpanConfig:
    """How prompts are cut into reusable spans (validated on construction)."""

    min_tokens: int = 64
    """Fewest tokens a span holds; shorter blocks are computed as ordinary prompt tokens."""
    max_tokens: int = 1024
    """Most tokens a span holds; a longer block is cut at content-defined points."""
    edge_line_tokens: int = 16
    """Lines shorter than this at a block's start or end (headers, tags, numbering) are
    left out of its span, at most `edge_lines` of them on each side."""
    edge_lines: int = 4
    cut_bits: int = 6
    """A long block is cut after a token where the rolling hash has this many low zero
    bits (on average every 2**cut_bits tokens), never before `min_tokens`."""
    window: int = 16
    """Tokens the rolling hash of a cut reads."""

    def __post_init__(self) -> None:
        if not 1 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"need 1 <= min_tokens <= max_tokens, got {self.min_tokens}, {self.max_tokens}")
        if self.edge_line_tokens < 0 or self.edge_lines < 0:
            raise ValueError("edge_line_tokens and edge_lines must be >= 0")
        if not 1 <= self.cut_bits <= 16 or not 1 <= self.window <= self.min_tokens:
            raise ValueError("cut_bits must be in [1, 16] and window in [1, min_tokens]")


@dataclass(frozen=True)
class Span:
    """Token positions [start, end) of one passage span in the searched ids."""

    start: int
    end: int

    def __len__(self) -> int:
        return self.end - self.start


class TokenClasses:
    """Per token id of one tokenizer: whether its text ends a line, ends with a blank
    line, and starts with whitespace. Built once per tokenizer from its own decoding."""

    def __init__(self, pieces: list[str], special: set[int] = frozenset()):
        self.pieces = np.array(pieces, dtype=object)
        """Each token's text, to find markup across tokens."""
        self.ends_line = np.array([p.endswith("\n") for p in pieces], dtype=bool)
        self.ends_blank_line = np.array([p.endswith("\n\n") or p.strip(" \t") == "\n" for p in pieces], dtype=bool)
        """A piece that ends with two line breaks, or is a lone line break (a blank line
        when the piece before it ended one)."""
        self.two_breaks = np.array([p.endswith("\n\n") for p in pieces], dtype=bool)
        self.leading_space = np.array([p[:1].isspace() for p in pieces], dtype=bool)
        self.whitespace = np.array([not p.strip() for p in pieces], dtype=bool)
        """Pieces of whitespace only: a span never starts or ends with one, so a passage's
        span does not depend on the separator that follows it (a blank line, or the end
        of a message)."""
        self.special = np.zeros(len(pieces), dtype=bool)
        """Template tokens (<|im_start|>, <start_of_turn>, ...): each starts a block."""
        self.special[[i for i in special if 0 <= i < len(pieces)]] = True

    @classmethod
    def of(cls, tokenizer) -> TokenClasses:
        size = len(tokenizer)
        pieces = tokenizer.batch_decode([[i] for i in range(size)], skip_special_tokens=False)
        special = {i for i, token in tokenizer.added_tokens_decoder.items() if token.special}
        return cls(pieces, set(tokenizer.all_special_ids) | special)


class SpanFinder:
    def __init__(self, tokenizer, config: SpanConfig = SpanConfig()):
        self.tokenizer = tokenizer
        self.config = config

    @cached_property
    def classes(self) -> TokenClasses:
        return TokenClasses.of(self.tokenizer)

    def prepare(self) -> None:
        """Build the token classes now (a server does at start-up) rather than on first use."""
        _ = self.classes

    def spans(self, token_ids: list[int], start: int = 0, end: int | None = None) -> list[Span]:
        """The passage spans in token_ids[start:end], ascending, positions in token_ids."""
        end = len(token_ids) if end is None else end
        if end - start <= self.config.min_tokens:
            return []
        ids = np.asarray(token_ids[start:end], dtype=np.int64)
        ids = np.clip(ids, 0, len(self.classes.ends_line) - 1)
        line_starts, block_starts = self._breaks(ids)
        markup = self._markup(ids)
        bounds = [0, *block_starts.tolist(), len(ids)]
        found = []
        for block_start, block_end in zip(bounds, bounds[1:]):
            for piece_start, piece_end in _unmarked(markup, block_start, block_end):
                lines = line_starts[(line_starts > piece_start) & (line_starts < piece_end)].tolist()
                for span_start, span_end in self._block_spans(ids, [piece_start, *lines, piece_end]):
                    if span_end < len(ids):  # the prompt's last token is the fusion's own
                        found.append(Span(start + span_start, start + span_end))
        return found

    def _markup(self, ids: np.ndarray) -> np.ndarray:
        """Per token: whether it holds part of an XML-like tag."""
        pieces = self.classes.pieces[ids]
        text = "".join(pieces)
        ends = np.cumsum([len(p) for p in pieces])
        marked = np.zeros(len(ids), dtype=bool)
        for match in _MARKUP.finditer(text):
            first = int(np.searchsorted(ends, match.start(), side="right"))
            last = int(np.searchsorted(ends, match.end() - 1, side="right"))
            marked[first : last + 1] = True
        return marked

    def _breaks(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(line starts, block starts): positions i where a new line (a new block) begins:
        token i-1 ends a line (a blank line) and token i does not start with whitespace."""
        classes = self.classes
        ends_line = classes.ends_line[ids]
        starts_word = ~classes.leading_space[ids]
        line = np.zeros(len(ids), dtype=bool)
        line[1:] = ends_line[:-1] & starts_word[1:]
        blank = classes.two_breaks[ids].copy()
        # a lone line break after a piece that ended a line is a blank line too
        blank[1:] |= classes.ends_blank_line[ids][1:] & ends_line[:-1]
        # a run of whitespace-only pieces carries the blank line to its last piece
        run = ~starts_word
        for i in range(1, len(ids)):
            if run[i] and blank[i - 1] and ends_line[i]:
                blank[i] = True
        block = np.zeros(len(ids), dtype=bool)
        block[1:] = (blank[:-1] & starts_word[1:]) | classes.special[ids][1:]
        return np.flatnonzero(line), np.flatnonzero(block)

    def _block_spans(self, ids: np.ndarray, bounds: list[int]) -> list[tuple[int, int]]:
        """The span(s) of one block whose lines start at `bounds` (its end last)."""
        config = self.config
        edges = list(zip(bounds, bounds[1:]))
        first, last = 0, len(edges)
        while first < min(config.edge_lines, last) and _short(edges[first], config):
            first += 1
        trailing = 0
        while (
            trailing < config.edge_lines
            and last > first
            and edges[last - 1][1] - edges[last - 1][0] < config.edge_line_tokens
        ):
            last -= 1
            trailing += 1
        if first >= last:
            return []
        span_start, span_end = edges[first][0], edges[last - 1][1]
        whitespace = self.classes.whitespace[ids]
        while span_end > span_start and whitespace[span_end - 1]:
            span_end -= 1
        while span_start < span_end and whitespace[span_start]:
            span_start += 1
        if span_end - span_start < config.min_tokens:
            return []
        return self._cut(ids, span_start, span_end)

    def _cut(self, ids: np.ndarray, start: int, end: int) -> list[tuple[int, int]]:
        """[start, end) in pieces of at most max_tokens, cut where the rolling hash of the
        last `window` tokens has `cut_bits` low zero bits (and never below min_tokens)."""
        config = self.config
        if end - start <= config.max_tokens:
            return [(start, end)]
        hashes = window_hashes(ids[start:end], config.window)
        mask = (1 << config.cut_bits) - 1
        cuts = np.flatnonzero((hashes & np.uint64(mask)) == 0) + 1  # cut after the window's last token
        pieces, piece_start = [], 0
        length = end - start
        for cut in cuts.tolist():
            if cut - piece_start < config.min_tokens or length - cut < config.min_tokens:
                continue
            while cut - piece_start > config.max_tokens:
                pieces.append((piece_start, piece_start + config.max_tokens))
                piece_start += config.max_tokens
            if cut - piece_start >= config.min_tokens:
                pieces.append((piece_start, cut))
                piece_start = cut
        while length - piece_start > config.max_tokens:
            pieces.append((piece_start, piece_start + config.max_tokens))
            piece_start += config.max_tokens
        pieces.append((piece_start, length))
        return [(start + a, start + b) for a, b in pieces]


def _unmarked(markup: np.ndarray, start: int, end: int) -> list[tuple[int, int]]:
    """The runs of [start, end) with no markup token."""
    runs, run_start = [], None
    for i in range(start, end):
        if markup[i]:
            if run_start is not None:
                runs.append((run_start, i))
            run_start = None
        elif run_start is None:
            run_start = i
    if run_start is not None:
        runs.append((run_start, end))
    return runs


def _short(line: tuple[int, int], config: SpanConfig) -> bool:
    return line[1] - line[0] < config.edge_line_tokens


def window_hashes(ids: np.ndarray, window: int) -> np.ndarray:
    """For each position i >= window - 1, a hash of ids[i - window + 1 .. i] (uint64), so a
    cut depends only on the tokens just before it; positions before that hash to 1."""
    out = np.ones(len(ids), dtype=np.uint64)
    if len(ids) < window:
        return out
    mixed = (ids.astype(np.uint64) + np.uint64(1)) * _HASH_MULTIPLIER
    mixed ^= mixed >> np.uint64(29)
    sums = np.zeros(len(ids) + 1, dtype=np.uint64)
    with np.errstate(over="ignore"):
        np.cumsum(mixed, out=sums[1:])
        windowed = sums[window:] - sums[:-window]
        windowed *= _HASH_MULTIPLIER
        windowed ^= windowed >> np.uint64(31)
    out[window - 1 :] = windowed
    return out
