"""Pause points inside long model passes, so that whoever drives a preparation can run
other work (the running requests' decode steps) between its pieces.

A `Pacer` is installed for the code that runs inside one preparation (a context
variable: each greenlet, thread or task sees its own). Two kinds of pass consult it:
  `CausalLM.prefill`  split into pieces of at most `Pacer.piece_tokens(start)` tokens,
                      each appended to the cache after the rows before it (the same causal
                      attention a whole prefill computes), with `Pacer.spent` after each;
  a fusion's recompute  reports each layer's rows as `rows / num_layers` tokens of work
                      (its rows all pass a layer together, since a check layer's row
                      selection reads every row, so it pauses between layers, never
                      within a layer's rows).
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


@contextlib.contextmanager
def paced(pacer: Pacer | None) -> Iterator[None]:
    """Install `pacer` for the code run inside the block."""
    token = _current.set(pacer)
    try:
        yield
    finally:
        _current.reset(token)
