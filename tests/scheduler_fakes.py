"""Stand-ins for the scheduler's model, cache and tokenizer (no weights), shared by the
scheduler's unit tests."""

from __future__ import annotations

import torch

from ragkv.engine.pass_cost import PassCost

VOCAB = 16
EOS = VOCAB - 1


class FakeCache:
    def __init__(self, length: int):
        self.length = length


class FakeTokenizer:
    def decode(self, ids, skip_special_tokens=True) -> str:
        return "".join(chr(ord("a") + i) for i in ids)


def logits(token: int) -> torch.Tensor:
    row = torch.zeros(VOCAB)
    row[token] = 1.0
    return row


class FakeModel:
    """`decode_batch` as the scheduler calls it: each row's next token is its last plus one
    (never end-of-sequence), and its cache grows by one row."""

    pass_cost = PassCost(context_scale=float("inf"))
    """Every token of a preparation's reported work costs one, at any context."""

    def __init__(self, trace: list[str] | None = None):
        self.batches: list[int] = []
        self.trace = trace

    def decode_batch(self, tokens, caches, attentions, release_window_rows):
        assert len(tokens) == len(caches) == len(attentions) == len(release_window_rows)
        self.batches.append(len(tokens))
        if self.trace is not None:
            self.trace.append("decode")
        for cache in caches:
            cache.length += 1
        return [logits((token + 1) % EOS) for token in tokens]
