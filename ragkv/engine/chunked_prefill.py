"""A full prefill run a bounded piece at a time, so whoever drives it can stop between pieces.

Each piece appends its tokens to the cache through `CausalLM.prefill` (the rows before it
are read from the cache, as a prompt continued turn by turn is), so the last piece's logits
are the whole prompt's next-token logits. The caller decides when to run the next piece;
between two pieces the prefill holds only its cache.
"""

from __future__ import annotations

import torch

from ragkv.engine.kv_cache import KVCache
from ragkv.engine.model import CausalLM


class ChunkedPrefill:
    def __init__(self, model: CausalLM, token_ids: list[int], piece_tokens: int):
        if not token_ids:
            raise ValueError("a prefill needs at least one token")
        if piece_tokens < 1:
            raise ValueError(f"piece_tokens must be >= 1, got {piece_tokens}")
        self.model = model
        self.token_ids = list(token_ids)
        self.piece_tokens = piece_tokens
        self.cache: KVCache | None = model.new_cache(len(self.token_ids))
        self.logits: torch.Tensor | None = None
        """The next-token logits after the whole prompt [vocab], once `done`."""

    @property
    def prefilled(self) -> int:
        """Prompt tokens already in the cache."""
        return self.cache.length if self.cache is not None else len(self.token_ids)

    @property
    def done(self) -> bool:
        return self.logits is not None

    def step(self) -> bool:
        """Prefill the next piece (at most `piece_tokens` tokens); True once the prompt is
        whole, when the cache is let go (only the logits are kept)."""
        if self.done:
            return True
        start = self.cache.length
        piece = torch.tensor(self.token_ids[start : start + self.piece_tokens])
        logits = self.model.prefill(piece, self.cache)
        if self.cache.length == len(self.token_ids):
            self.logits = logits
            self.cache = None
        return self.done
