"""Kernels that take query rows sorted by position, called with rows in any order."""

from __future__ import annotations

from collections.abc import Callable

import torch


def by_position(
    q_rows: torch.Tensor, row_positions: torch.Tensor, run: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
) -> torch.Tensor:
    """`run(q, positions)` over q_rows [H, N, D] sorted by position (stably, positions as
    int64), its output [H, N, D] put back in the callers' row order."""
    positions = row_positions.long()
    if q_rows.shape[1] < 2 or not bool((positions[1:] < positions[:-1]).any()):
        return run(q_rows, positions)
    order = torch.argsort(positions, stable=True)
    out = run(q_rows[:, order], positions[order])
    unsorted = torch.empty_like(out)
    unsorted[:, order] = out
    return unsorted
