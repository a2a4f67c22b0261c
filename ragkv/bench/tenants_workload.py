"""The two tenants' traffic of `ragkv bench tenants` and the figures drawn from it (no server).

Tenant A asks questions pasting a few passages drawn from a fixed pool; tenant B pastes
passage sets never seen before, each asked `b_repeats` times (recurring: B's entries are
read again, so they are promoted as A's are) or once (a one-off flood), `b_rate` B requests
to each of A's. A's hit rate is the share of its pasted passages' tokens the response's
`usage.prompt_tokens_details.cached_tokens` says were reused, over its last `last` questions.
"""

from __future__ import annotations

import random
import statistics
from dataclasses import dataclass
from pathlib import Path

from ragkv.bench.datasets import Example
from ragkv.bench.prompt_shapes import SHAPES, Passage

MODES = ("recurring", "flood")
"""B's traffic: each new set asked b_repeats times, or once."""


@dataclass(frozen=True)
class TenantsConfig:
    dataset: Path
    a_questions: int = 10
    """A's questions in each phase (A alone, then A beside B)."""
    a_pool: int = 8
    """Passages A's questions draw from."""
    passages: int = 2
    """Passages pasted into each prompt, A's and B's."""
    last: int = 5
    """A's hit rate is taken over its last `last` questions of a phase."""
    b_rate: float = 4.0
    """B's requests per A question."""
    b_repeats: int = 2
    """Recurring mode: how many times B asks about each of its sets."""
    passage_words: int = 0
    """Passages cut to this many words (0: whole). Whole by default: the span finder finds
    a cut passage's stored KV less often than a whole one's, which would lower A's hit
    rate alone and beside B alike and hide what B's traffic takes."""
    max_tokens: int = 4
    cold: int = 5
    """Cold prompts (passages no one pasted) sent into the empty store before A's pool, and
    as many again once the store is at its cap: what eviction adds to a cold prompt."""
    capacity_mb: float | None = None
    """The store's cap; None = capacity_pools x A's pool bytes, measured on an uncapped start."""
    capacity_pools: float = 3.0
    budget_share: float = 0.5
    """With budgets: each tenant's store_budget_bytes as a share of the capacity."""
    modes: tuple[str, ...] = MODES
    budgets: tuple[bool, ...] = (False, True)
    seed: int = 0
    model: str | None = None
    serve_options: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.a_questions < 1 or not 1 <= self.last <= self.a_questions:
            raise ValueError(f"need a_questions >= 1 and 1 <= last <= a_questions, got {self.a_questions}, {self.last}")
        if not 1 <= self.passages <= self.a_pool:
            raise ValueError(f"need 1 <= passages <= a_pool, got {self.passages}, {self.a_pool}")
        if not self.b_rate > 0 or self.b_repeats < 2:
            raise ValueError(
                f"need b_rate > 0 and b_repeats >= 2 (recurring sets), got {self.b_rate}, {self.b_repeats}"
            )
        if self.passage_words < 0 or self.max_tokens < 1 or self.cold < 0:
            raise ValueError("need passage_words >= 0, max_tokens >= 1 and cold >= 0")
        if self.capacity_mb is not None and not self.capacity_mb > 0:
            raise ValueError(f"capacity_mb must be > 0, got {self.capacity_mb}")
        if not self.capacity_pools > 0 or not 0 < self.budget_share <= 1:
            raise ValueError("need capacity_pools > 0 and 0 < budget_share <= 1")
        if not self.modes or set(self.modes) - set(MODES) or not self.budgets:
            raise ValueError(f"modes must be among {list(MODES)} and budgets not empty, got {self.modes}")

    def b_requests(self) -> int:
        return round(self.b_rate * self.a_questions)


@dataclass(frozen=True)
class Prompt:
    tenant: str
    body: dict
    reusable_tokens: int = 0
    """Tokens of the pasted passages: what the store could give back."""


@dataclass(frozen=True)
class Answer:
    tenant: str
    ok: bool
    ttft_s: float = 0.0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    reusable_tokens: int = 0


def interleave(a_count: int, b_rate: float) -> list[str]:
    """Who sends next: B's requests spread among A's, round(b_rate x (i + 1)) of them sent
    before A's question i, so B's traffic always precedes what A is asked."""
    order, b_sent = [], 0
    for i in range(a_count):
        due = round(b_rate * (i + 1))
        order += ["B"] * (due - b_sent) + ["A"]
        b_sent = due
    return order


def passage_pool(examples: list[Example], words: int, seed: int) -> list[str]:
    """Every distinct passage of the set, cut to `words`, in a seeded order."""
    pool = sorted({" ".join(p.split()[:words]) if words else p.strip() for e in examples for p in e.passages})
    random.Random(seed).shuffle(pool)
    return pool


def body(passages: list[str], question: str, max_tokens: int) -> dict:
    chosen = [Passage(text, f"passage {i}", i) for i, text in enumerate(passages)]
    return {
        "model": "ragkv",
        "messages": SHAPES["blank_lines"].messages(chosen, question),
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


def hit_rate(answers: list[Answer]) -> float | None:
    """Cached prompt tokens over the pasted passages' tokens (None with no answer)."""
    done = [a for a in answers if a.ok]
    reusable = sum(a.reusable_tokens for a in done)
    return round(sum(a.cached_tokens for a in done) / reusable, 4) if reusable else None


def ttft_p50(answers: list[Answer]) -> float | None:
    done = [a.ttft_s for a in answers if a.ok]
    return round(statistics.median(done), 4) if done else None


def ratio(value: float | None, reference: float | None) -> float | None:
    return round(value / reference, 4) if value is not None and reference else None


class Traffic:
    """Both tenants' prompts; `tokens(text)` counts a passage's tokens as the server's
    tokenizer does."""

    def __init__(self, config: TenantsConfig, examples: list[Example], tokens) -> None:
        self.config, self.tokens = config, tokens
        self.questions = [e.question for e in examples]
        pool = passage_pool(examples, config.passage_words, config.seed)
        self.a_pool, self.b_pool = pool[: config.a_pool], pool[config.a_pool :]
        needed = (config.b_requests() + 2 * config.cold) * config.passages
        if len(self.b_pool) <= needed:  # one more for the warm-up
            raise ValueError(
                f"{config.dataset} holds {len(pool)} distinct passages; B's flood and the cold prompts need "
                f"{needed} beyond A's {config.a_pool}: ask fewer questions, a lower b_rate, fewer cold prompts "
                "or fewer passages"
            )
        self.restart()

    def restart(self) -> None:
        """Draw the same prompts again: every server is asked the same."""
        self.rng = random.Random(self.config.seed)

    def warm_up(self) -> Prompt:
        """B's prompt on a passage no phase pastes: the server's first request, so its
        start-up costs fall on no figure."""
        return self._prompt("B", self.b_pool[-1:])

    def cold_prompts(self, at_capacity: bool) -> list[Prompt]:
        """B's prompts on sets no other prompt pastes, taken from the pool's end (before the
        warm-up's passage): one list for the empty store, another for the store at its cap."""
        size, count = self.config.passages, self.config.cold
        end = len(self.b_pool) - 1 - (count * size if at_capacity else 0)
        return [self._prompt("B", self.b_pool[end - (i + 1) * size : end - i * size]) for i in range(count)]

    def _prompt(self, tenant: str, passages: list[str]) -> Prompt:
        question = self.questions[self.rng.randrange(len(self.questions))]
        reusable = sum(self.tokens(p) for p in passages)
        return Prompt(tenant, body(passages, question, self.config.max_tokens), reusable)

    def a_pool_prompts(self) -> list[Prompt]:
        """A's pool pasted once, `passages` at a time: asked before A's figures are taken,
        so A alone is measured with its pool stored, as A beside B is."""
        size = self.config.passages
        return [self._prompt("A", self.a_pool[i : i + size]) for i in range(0, len(self.a_pool), size)]

    def a_prompts(self) -> list[Prompt]:
        """A's questions of one phase: shuffled subsets of its pool."""
        count = self.config.passages
        return [self._prompt("A", self.rng.sample(self.a_pool, count)) for _ in range(self.config.a_questions)]

    def b_prompts(self, mode: str) -> list[Prompt]:
        """B's requests of one phase: new sets, each asked b_repeats times in a row
        (recurring) or once (flood)."""
        if mode not in MODES:
            raise ValueError(f"mode must be one of {list(MODES)}, got {mode!r}")
        repeats = self.config.b_repeats if mode == "recurring" else 1
        count, size = self.config.b_requests(), self.config.passages
        prompts = []
        for number in range(-(-count // repeats)):
            chosen = self.b_pool[number * size : (number + 1) * size]
            prompts += [self._prompt("B", chosen) for _ in range(repeats)]
        return prompts[:count]

    def phase(self, mode: str | None) -> list[Prompt]:
        """A's questions alone (mode None) or with B's requests interleaved."""
        a_prompts = iter(self.a_prompts())
        if mode is None:
            return list(a_prompts)
        b_prompts = iter(self.b_prompts(mode))
        return [
            next(a_prompts if who == "A" else b_prompts)
            for who in interleave(self.config.a_questions, self.config.b_rate)
        ]
