#!/usr/bin/env python
"""A RAG chat through LangChain's `ChatOpenAI` against a running `ragkv serve`.

    ragkv serve &
    python examples/client_httpx.py       # ingests examples/corpus (once)
    python examples/client_langchain.py

LangChain resends the whole history on every call and knows no session ids; ragkv finds
the earlier turns' KV by token prefix, so a follow-up computes only its new tokens
(`usage_metadata["input_token_details"]["cache_read"]`). ragkv's `rag` options travel in
`extra_body`. Works offline: nothing but the local server is contacted.
"""

from __future__ import annotations

import os
import time

from langchain_core.messages import AIMessage, HumanMessage, SystemMessage
from langchain_openai import ChatOpenAI

chat = ChatOpenAI(model="ragkv", base_url=os.environ.get("RAGKV_URL", "http://127.0.0.1:8000") + "/v1",
                  api_key=os.environ.get("RAGKV_API_KEY", "none"), temperature=0, max_tokens=48, stream_usage=True,
                  extra_body={"rag": {"top_k": 3}})

messages = [SystemMessage("You answer from the documents, briefly."),
            HumanMessage("When was Gull Point Light automated?")]
for question in (None, "Who was its last resident keeper?"):
    if question is not None:
        messages.append(HumanMessage(question))
    started, first_token_at, pieces, usage = time.perf_counter(), None, [], None
    for chunk in chat.stream(messages):
        if chunk.content and first_token_at is None:
            first_token_at = time.perf_counter() - started
        pieces.append(chunk.content)
        usage = chunk.usage_metadata or usage
    answer = "".join(pieces).strip()
    messages.append(AIMessage(answer))
    cached = usage["input_token_details"].get("cache_read", 0)
    print(f"{messages[-2].content}\n  {answer}\n  first token after {first_token_at:.3f} s; "
          f"{cached} of {usage['input_tokens']} prompt tokens cached\n")
