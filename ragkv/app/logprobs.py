"""Log-probabilities of generated tokens, as a request collects them (OpenAI's `logprobs`).

Each accepted token (not the end-of-sequence token, which is no part of the answer) gets a
`TokenLogprob` computed from the very logits it was sampled from (engine.sampling
.log_probabilities). A token's `text` is its own decoding; a multi-byte character split
over tokens shows as replacement characters there, and `raw` keeps the UTF-8 bytes the
tokenizer maps the token to when it has them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ragkv.engine.sampling import log_probabilities


@dataclass(frozen=True)
class Alternative:
    token_id: int
    text: str
    logprob: float


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    text: str
    logprob: float
    top: tuple[Alternative, ...] = field(default_factory=tuple)


def token_logprob(logits: torch.Tensor, token: int, top_n: int, tokenizer) -> TokenLogprob:
    chosen, top = log_probabilities(logits, token, top_n)

    def text(token_id: int) -> str:
        return tokenizer.decode([token_id])

    return TokenLogprob(token, text(token), chosen, tuple(Alternative(i, text(i), v) for i, v in top))
