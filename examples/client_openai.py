#!/usr/bin/env python
"""A multi-turn RAG chat with the `openai` package against a running `ragkv serve`.

    ragkv serve &                      # or: docker compose up
    python examples/client_httpx.py    # ingests examples/corpus (once) and asks on /v1/query
    python examples/client_openai.py

Environment: RAGKV_URL (default http://127.0.0.1:8000), RAGKV_API_KEY (when the server
has --api-keys; any string otherwise).

ragkv's extensions travel in `extra_body`: `rag` (top_k, document_ids, strategy, ratio,
enabled) and `session_id`. The reply carries `session_id` and `rag` (citations, timings,
turn); with a session only the new message is sent, the rest is in the server's KV.
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
first = client.chat.completions.create(
    model=model,
    messages=[{"role": "user", "content": "When was Gull Point Light automated?"}],
    max_tokens=48,
    extra_body={"rag": {"top_k": 3, "strategy": "a3", "ratio": 0.15}},
)
session_id = first.session_id
print(f"\nturn 1: {first.choices[0].message.content}")
for citation in first.rag["citations"]:
    print(f"  cited {citation['name']} chunk {citation['chunk_index']} (score {citation['score']:.3f})")
print(f"  TTFT {first.rag['timings']['ttft']:.3f} s; usage {first.usage.prompt_tokens} prompt tokens, "
      f"{first.usage.reused_tokens} reused")

# Turn 2, streamed: the session's KV is reused; only the previous answer and this message are computed.
started = time.perf_counter()
first_token_at = None
stream = client.chat.completions.create(
    model=model,
    messages=[{"role": "user", "content": "Who was its last resident keeper?"}],
    max_tokens=48,
    stream=True,
    stream_options={"include_usage": True},
    extra_body={"session_id": session_id},
)
print("\nturn 2: ", end="", flush=True)
for chunk in stream:
    if chunk.choices and chunk.choices[0].delta.content:
        first_token_at = first_token_at or time.perf_counter() - started
        print(chunk.choices[0].delta.content, end="", flush=True)
    if chunk.choices and chunk.choices[0].finish_reason:
        server_ttft = chunk.rag["timings"]["ttft"]
    if chunk.usage:
        usage = chunk.usage
print(f"\n  TTFT {server_ttft:.3f} s on the server, {first_token_at:.3f} s here; "
      f"{usage.computed_tokens} of {usage.prompt_tokens} prompt tokens computed")

# Sessions expire on their own; this drops it now.
httpx.delete(f"{client.base_url}sessions/{session_id}", headers={"Authorization": f"Bearer {client.api_key}"}).raise_for_status()
