"""The one check that a prompt and its answer fit the model's context: queries, chat turns
and completions refuse the same way (400 context_length_exceeded in the API)."""

from __future__ import annotations

from ragkv.engine import Engine
from ragkv.errors import InputError


def check_context_length(
    engine: Engine, prompt_tokens: int, max_new_tokens: int, prompt: str = "the prompt", hint: str = "lower max_tokens"
) -> None:
    """InputError unless `prompt_tokens` positions plus `max_new_tokens` fit the model's context.
    `prompt` names what is too long; `hint` says what the client may change."""
    limit = engine.spec.rope.max_position_embeddings
    needed = prompt_tokens + max_new_tokens
    if needed > limit:
        raise InputError(
            "context_length_exceeded",
            f"{prompt} is {prompt_tokens} tokens and max_tokens is {max_new_tokens}: {needed} positions, "
            f"above the model's context of {limit}; {hint}",
        )
