"""What POST /v1/chat/completions/render and /v1/completions/render answer: vLLM's
GenerateRequest (vllm.entrypoints.serve.disagg.protocol), the request as the engine would
run it, tokens in. vllm-router and llm-d's precise prefix-cache routing read its
`token_ids` to find the replica that holds the longest cached prefix; the rest says how
the request would be sampled."""

from __future__ import annotations

import uuid

from pydantic import BaseModel, Field

from ragkv.api.common.protocol import GenerationRequest, StreamOptions
from ragkv.app.request_types import GenerationConfig


class RenderedSampling(BaseModel):
    """vLLM's SamplingParams: the fields this server honours."""

    n: int = 1
    temperature: float
    top_p: float
    seed: int | None
    stop: list[str]
    max_tokens: int
    logprobs: int | None = Field(description="alternatives reported per answer token; null: none")


class RenderedPrompt(BaseModel):
    request_id: str = Field(description="chatcmpl-... or cmpl-..., as vLLM names them")
    token_ids: list[int] = Field(description="the prompt's token ids, as the request would prefill them")
    features: dict | None = Field(None, description="multimodal features: always null (prompts are text)")
    sampling_params: RenderedSampling
    model: str | None
    stream: bool
    stream_options: StreamOptions | None = None
    cache_salt: str | None = Field(None, description="the request's cache_salt, when it sent one")
    priority: int = 0
    kv_transfer_params: dict | None = None


def rendered_prompt(
    kind: str,
    token_ids: list[int],
    body: GenerationRequest,
    generation: GenerationConfig,
    stream: bool,
    stream_options: StreamOptions | None,
) -> RenderedPrompt:
    """`kind`: chatcmpl or cmpl, the request id's prefix."""
    sampling = generation.sampling
    salt = (body.model_extra or {}).get("cache_salt")
    return RenderedPrompt(
        request_id=f"{kind}-{uuid.uuid4().hex}",
        token_ids=token_ids,
        sampling_params=RenderedSampling(
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            seed=sampling.seed,
            stop=list(generation.stop),
            max_tokens=generation.max_new_tokens,
            logprobs=generation.logprobs,
        ),
        model=body.model,
        stream=stream,
        stream_options=stream_options if stream else None,
        cache_salt=salt if isinstance(salt, str) else None,
    )
