"""A request's preparation run a bounded piece per scheduler step (chunked prefill, as
Sarathi-Serve and vLLM's `--max-num-batched-tokens` do), so the running requests' decode
steps go on while a long prompt is prefilled or a fusion recomputes its rows.

The preparation (the request's `prepare`: retrieve, load, fuse, or a prefill) runs in a
greenlet on the scheduler's own thread (the engine's thread: one OpenMP pool, one CUDA
stream), with a `StepPacer` installed (ragkv.engine.pacing). The scheduler `advance`s it
once per step with that step's room (the token budget less the rows its batch decodes);
the engine's prefill cuts its tokens into pieces that fit the room and the fusion's
recompute reports each layer's rows, and once the room is spent the greenlet switches
back to the scheduler, which runs the batched decode step and resumes it next step. A
preparation that never reaches the model (a cached answer, a stand-in) ends in one step.

Both sides of a switch run under `torch.inference_mode()`, so the thread-local autograd
state a paused pass leaves set is the one the scheduler's side expects.
"""

from __future__ import annotations

import contextvars

import greenlet
import torch

from ragkv.app.request import Request
from ragkv.engine import pacing
from ragkv.engine.pass_cost import PassCost


class StepPacer:
    """Counts the work of one step's piece, each token weighed by what it costs at its
    context (PassCost); pauses the preparation once the room is spent."""

    def __init__(self, cost: PassCost) -> None:
        self.cost = cost
        self.room = 0.0
        self.pieces = 0
        """Pauses so far (steps the preparation spanned, less one)."""
        self._driver: greenlet.greenlet | None = None

    def start_step(self, room: int, driver: greenlet.greenlet) -> None:
        """A new step's room; `driver` is switched back to once it is spent."""
        self.room = float(max(1, room))
        self._driver = driver

    def piece_tokens(self, start: int) -> int:
        return self.cost.tokens_within(max(1.0, self.room), start)

    def spent(self, tokens: float, context: float) -> None:
        self.room -= self.cost.cost(tokens, context)
        if self.room <= 0 and self._driver is not None:
            self.pieces += 1
            self._driver.switch()


class SteppedPreparation:
    def __init__(self, request: Request, tokenizer, cost: PassCost):
        self.request = request
        self.pacer = StepPacer(cost)
        self._tokenizer = tokenizer
        self._greenlet = greenlet.greenlet(self._run)
        self._greenlet.gr_context = contextvars.copy_context()

    def _run(self) -> None:
        with torch.inference_mode(), pacing.paced(self.pacer):
            self.request.prepare(self._tokenizer)

    @property
    def done(self) -> bool:
        return self._greenlet.dead

    def advance(self, room: int) -> bool:
        """Run the preparation until `room` tokens of work are spent or it ends; True once
        it ended. Its failure is raised here."""
        driver = greenlet.getcurrent()
        self.pacer.start_step(room, driver)
        self._greenlet.parent = driver
        with torch.inference_mode():
            self._greenlet.switch()
        return self.done

    def cancel(self, error: BaseException) -> None:
        """Stop a paused preparation: `error` is raised at its pause point, so what it holds
        (open sessions, caches) is let go by its own handlers."""
        if not self._greenlet or self.done:
            return  # never started, or ended
        try:
            with torch.inference_mode():
                self._greenlet.throw(error)
        except BaseException:
            pass  # the preparation ended by the error, as intended
