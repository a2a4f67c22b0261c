"""Anchors: where a prompt's tokens are found inside passages stored from other prompts.

A stored passage (a run of rows with its token ids) is indexed by a few of its positions,
chosen by content alone, so that any stretch of text two prompts share holds the same
anchors in both, wherever the stretch starts or ends:

    window hash at each position (the last `window` token ids)
    ─► winnowing: in every `winnow` consecutive hashes the smallest is an anchor
       (Schleimer, Wilkerson, Aiken 2003; the rightmost on ties)

Any run of `window + winnow - 1` or more shared tokens then holds a common anchor: two
chunks that a splitter cut with overlap, a passage quoted under another tag, a passage
whose first or last token merged with the markup around it all find their stored rows.
The store keeps per anchor the run that holds it and where; a look-up reads the run and
extends the match token by token on both sides, so what is reused is exactly the shared
stretch (checked against the stored ids), not a block around it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ragkv.app.passages.finder import window_hashes


@dataclass(frozen=True)
class AnchorConfig:
    """How anchors are chosen and matches kept (validated on construction)."""

    window: int = 12
    """Token ids an anchor's hash (and its key) reads."""
    winnow: int = 24
    """Hashes per winnowing window: every shared stretch of window + winnow - 1 tokens holds
    an anchor of both prompts; about 2 / (winnow + 1) of positions are anchors."""
    min_match: int = 16
    """Fewest shared tokens placed from a stored run (shorter stretches are computed)."""
    min_run: int = 16
    """Fewest new tokens of a passage stored as a run of their own."""

    def __post_init__(self) -> None:
        if not 4 <= self.window <= 64 or not 1 <= self.winnow <= 256:
            raise ValueError("need 4 <= window <= 64 and 1 <= winnow <= 256")
        if self.min_match < self.window or self.min_run < 1:
            raise ValueError("min_match must be >= window and min_run >= 1")

    @property
    def guaranteed(self) -> int:
        """Shared stretches at least this long are always found."""
        return self.window + self.winnow - 1


def anchor_positions(ids: np.ndarray, config: AnchorConfig) -> np.ndarray:
    """Positions (the last token of each anchor's window) chosen in `ids`, ascending."""
    window, winnow = config.window, config.winnow
    if len(ids) < window:
        return np.zeros(0, dtype=np.int64)
    hashes = window_hashes(ids, window)[window - 1 :]
    if len(hashes) <= winnow:
        return np.array([window - 1 + _rightmost_min(hashes)], dtype=np.int64)
    windows = np.lib.stride_tricks.sliding_window_view(hashes, winnow)
    rightmost = winnow - 1 - np.argmin(windows[:, ::-1], axis=1)
    chosen = np.unique(np.arange(len(windows)) + rightmost)
    return chosen + window - 1


def _rightmost_min(hashes: np.ndarray) -> int:
    return len(hashes) - 1 - int(np.argmin(hashes[::-1]))


@dataclass(frozen=True)
class AnchorRecord:
    """What the store keeps of one anchor: the run that holds it and its offset there."""

    run: str
    offset: int

    def tensors(self) -> dict[str, torch.Tensor]:
        return {
            "run": torch.frombuffer(bytearray(bytes.fromhex(self.run)), dtype=torch.uint8),
            "offset": torch.tensor([self.offset], dtype=torch.int32),
        }

    @classmethod
    def of(cls, tensors: dict | None) -> AnchorRecord | None:
        """The record of stored tensors; None when absent or not an anchor's."""
        if tensors is None or "run" not in tensors or "offset" not in tensors:
            return None
        run, offset = tensors["run"], tensors["offset"]
        if run.dtype != torch.uint8 or run.numel() != 16 or offset.numel() != 1:
            return None
        return cls(bytes(run.tolist()).hex(), int(offset))


def extend(ids: np.ndarray, position: int, run: np.ndarray, offset: int, low: int, high: int) -> tuple[int, int]:
    """The stretch [a, b) of `ids` (within [low, high)) equal to `run` around the aligned
    pair ids[position] = run[offset]: (a, b) with a == b when they differ there."""
    if not (low <= position < high and 0 <= offset < len(run)) or ids[position] != run[offset]:
        return position, position
    left = min(position - low, offset)
    back = ids[position - left : position][::-1] != run[offset - left : offset][::-1]
    start = position - (int(np.argmax(back)) if back.any() else left)
    right = min(high - position, len(run) - offset)
    ahead = ids[position : position + right] != run[offset : offset + right]
    end = position + (int(np.argmax(ahead)) if ahead.any() else right)
    return start, end
