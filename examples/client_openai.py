#!/usr/bin/env python
"""A multi-turn RAG chat with the `openai` package against a running `ragkv serve`.

    ragkv serve &                      # or: docker compose up
    python examples/client_httpx.py    # ingests examples/corpus (once) and asks on /v1/query
    python examples/client_openai.py

Environment: RAGKV_URL (default http://127.0.0.1:8000), RAGKV_API_KEY (when the server
has --api-keys; any string otherwise).

Turn 2 is sent the OpenAI way: the whole history again, no session id. The server finds
the KV of turn 1 by its token prefix and computes only the new tokens; the reply's
`usage.prompt_tokens_details.cached_tokens` says how many prompt tokens were reused.

ragkv's extensions travel in `extra_body`: `rag` (top_k, document_ids, strategy, ratio,
enabled) and `session_id` (an explicit handle: continue a named context; 404 when it is
unknown or expired). The reply carries `session_id` and `rag` (citations, timings, turn).
"""

from __future__ import annotations

import os
import time

import httpx
import openai

client = openai.OpenAI(base_url=os.environ.get("RAGKV_URL", "http://127.0.0.1:8000") + "/v1",
                       api_key=os.environ.get("RAGKV_API_KEY", "none"))
model = client.models.list().data[0].id
print(f"model: {model}")

# Turn 1: retrieval + fusion of the retrieved chunks' stored KV.
messages = [{"role": "system", "content": "You answer from the documents, briefly."},
            {"role": "user", "content": "When was Gull Point Light automated?"}]
first = client.chat.completions.create(
    model=model,
    messages=messages,
    max_tokens=48,
    extra_body={"rag": {"top_k": 3, "strategy": "probe", "ratio": 0.1}},
)
print(f"\nturn 1: {first.choices[0].message.content}")
for citation in first.rag["citations"]:
    print(f"  cited {citation['name']} chunk {citation['chunk_index']} (score {citation['score']:.3f})")
print(f"  TTFT {first.rag['timings']['ttft']:.3f} s; usage {first.usage.prompt_tokens} prompt tokens, "
      f"{first.usage.prompt_tokens_details.cached_tokens} cached (stored chunk KV)")

# Turn 2, streamed, the whole history resent without a session id: turn 1's KV is found
# by prefix; only the new tokens are computed.
messages += [{"role": "assistant", "content": first.choices[0].message.content},
             {"role": "user", "content": "Who was its last resident keeper?"}]
started = time.perf_counter()
first_token_at = None
stream = client.chat.completions.create(
    model=model,
    messages=messages,
    max_tokens=48,
    stream=True,
    stream_options={"include_usage": True},
    extra_body={"rag": {"top_k": 3}},
)
print("\nturn 2: ", end="", flush=True)
for chunk in stream:
    if chunk.choices and chunk.choices[0].delta.content:
        first_token_at = first_token_at or time.perf_counter() - started
        print(chunk.choices[0].delta.content, end="", flush=True)
    if chunk.choices and chunk.choices[0].finish_reason:
        server_ttft = chunk.rag["timings"]["ttft"]
        session_id = chunk.session_id
    if chunk.usage:
        usage = chunk.usage
print(f"\n  TTFT {server_ttft:.3f} s on the server, {first_token_at:.3f} s here; "
      f"{usage.prompt_tokens_details.cached_tokens} of {usage.prompt_tokens} prompt tokens cached")

# Cached contexts expire on their own (or are evicted); this drops turn 2's now.
httpx.delete(f"{client.base_url}sessions/{session_id}", headers={"Authorization": f"Bearer {client.api_key}"}).raise_for_status()
