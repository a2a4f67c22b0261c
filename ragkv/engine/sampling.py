"""Next-token choice: greedy, or temperature + nucleus (top-p) sampling with a seed."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingConfig:
    temperature: float = 0.0
    """0 means greedy (argmax); otherwise logits are divided by it before sampling."""
    top_p: float = 1.0
    """Keep the smallest set of tokens whose probability mass reaches top_p."""
    seed: int | None = None
    """Seed for reproducible sampling; None draws from torch's global generator."""

    def __post_init__(self) -> None:
        if not 0.0 <= self.temperature <= 10.0:
            raise ValueError(f"temperature must be in [0, 10], got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.seed is not None and not -(2**63) <= self.seed < 2**64:
            raise ValueError(f"seed must fit in 64 bits ([-2**63, 2**64 - 1]), got {self.seed}")


class Sampler:
    def __init__(self, config: SamplingConfig):
        self.config = config
        self.generator = None
        if config.seed is not None and config.temperature > 0.0:  # greedy decoding draws nothing
            self.generator = torch.Generator().manual_seed(config.seed)

    def __call__(self, logits: torch.Tensor) -> int:
        if self.config.temperature == 0.0:
            return int(logits.argmax())
        # Shift, then scale in float64: a tiny temperature (even 5e-324) must give the argmax,
        # not 0 / 0 or inf - inf = NaN.
        shifted = logits.double() - logits.max().double()
        probs = torch.softmax(shifted / self.config.temperature, dim=-1)
        if self.config.top_p < 1.0:
            sorted_probs, order = probs.sort(descending=True)
            # Drop a token when the mass before it already reaches top_p; the first always stays.
            drop = sorted_probs.cumsum(-1) - sorted_probs >= self.config.top_p
            drop[0] = False  # guaranteed, whatever the rounding of the sums
            sorted_probs[drop] = 0.0
            probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
        return int(torch.multinomial(probs.cpu(), 1, generator=self.generator))


def log_probabilities(logits: torch.Tensor, token: int, top_n: int) -> tuple[float, list[tuple[int, float]]]:
    """The model's log-probability of `token` and its `top_n` most likely tokens (id, log-prob),
    from the logits the token was sampled from: log-softmax of the raw logits, before
    temperature and top-p (what OpenAI and vLLM report), in float64 so that a greedy
    token's value is exactly the top alternative's."""
    logprobs = torch.log_softmax(logits.double(), dim=-1)
    chosen = float(logprobs[token])
    if top_n == 0:
        return chosen, []
    values, ids = logprobs.topk(top_n)
    return chosen, [(int(i), float(v)) for i, v in zip(ids.tolist(), values.tolist())]
