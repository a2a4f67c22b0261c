"""Pause points inside long model passes, so that whoever drives a preparation can run
other work (the running requests' decode steps) between its pieces.

A `Pacer` is installed for the code that runs inside one preparation (a context
variable: each greenlet, thread or task sees its own). Two kinds of pass consult it:
  `CausalLM.prefill`  split into pieces of at most `Pacer.piece_tokens(start)` tokens,
                      each appended to the cache after the rows before it (the same causal
                      attention a whole prefill computes), with `Pacer.spent` after each;
  a fusion's recompute  runs each layer's attention and the rest of the layer in pieces
                      of rows (`layer_pieces`), `rows / num_layers` tokens of work each:
                      the layer's K/V of every row is written first, so a piece's queries
                      read what a whole pass reads (and a check layer's row selection,
                      which reads every row, comes before its pieces).
Each report names the rows the tokens attend to on average, so a pacer can weigh a token
late in a long prompt by what it costs there (ragkv.engine.pass_cost).
With no pacer installed (the default) nothing pauses and nothing is split.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar
from typing import Protocol


class Pacer(Protocol):
    def piece_tokens(self, start: int) -> int:
        """Tokens the next prefill piece, from cache row `start`, may have (>= 1)."""
        ...

    def spent(self, tokens: float, context: float) -> None:
        """`tokens` rows were computed (a prefill piece's, or a fraction for a layer of
        rows), each attending to `context` rows on average; may pause the caller until the
        driver resumes it."""
        ...


_current: ContextVar[Pacer | None] = ContextVar("ragkv_pacer", default=None)


def current() -> Pacer | None:
    return _current.get()


def spent(tokens: float, context: float) -> None:
    """Report work to the installed pacer, if any."""
    pacer = _current.get()
    if pacer is not None:
        pacer.spent(tokens, context)


def layer_pieces(rows: int, num_layers: int, context: float) -> Iterator[slice]:
    """Slices of one layer's `rows`, each as large as the installed pacer's room takes (one
    slice of all without a pacer); a piece is reported as spent when the next is asked for
    (or the slices end), so the caller computes it first."""
    pacer = _current.get()
    start = 0
    while start < rows:
        size = rows - start
        if pacer is not None:
            size = min(size, max(1, pacer.piece_tokens(int(context)) * num_layers))
        yield slice(start, start + size)
        start += size
        if pacer is not None:
            pacer.spent(size / num_layers, context)


@contextlib.contextmanager
def paced(pacer: Pacer | None) -> Iterator[None]:
    """Install `pacer` for the code run inside the block."""
    token = _current.set(pacer)
    try:
        yield
    finally:
        _current.reset(token)
