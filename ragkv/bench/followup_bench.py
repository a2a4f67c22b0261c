"""`ragkv bench followup`: a follow-up chat turn sent the way OpenAI clients send it.

For each client (the official `openai` package, then LangChain's `ChatOpenAI`), over a
fresh ~6K-token document (one MuSiQue sample's passages, or a given text file):
  turn 1  [user q1] with retrieval restricted to the document (all of its chunks);
  turn 2  [user q1, assistant a1, user q2]: the whole history again, NO session id.
Reported per turn: client TTFT (request sent -> first content chunk), the server's TTFT
(arrival -> first token) with its parts, prompt tokens and cached tokens (OpenAI's
usage.prompt_tokens_details.cached_tokens).

Without --url it starts `ragkv serve` on a free port over a scratch data folder.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import httpx

FOLLOW_UP = "Can you say that in one short sentence?"


def _samples(path: Path, count: int) -> list[tuple[str, str]]:
    data = json.loads(path.read_text())
    return [("\n\n".join(ctx["text"] for ctx in sample["ctxs"]), sample["question"]) for sample in data[:count]]


def _ingest(http: httpx.Client, text: str, name: str) -> tuple[str, int]:
    response = http.post("/v1/documents", json={"text": text, "name": name, "background": False})
    response.raise_for_status()
    body = response.json()
    return body["document"]["id"], body["ingest"]["chunks"]


def _openai_turn(client, messages: list[dict], rag: dict, max_tokens: int) -> dict:
    started = time.perf_counter()
    first = last = None
    text, final, usage = [], None, None
    stream = client.chat.completions.create(
        model="ragkv",
        messages=messages,
        max_tokens=max_tokens,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"rag": rag},
    )
    for chunk in stream:
        if chunk.choices:
            delta = chunk.choices[0].delta.content or ""
            if delta and first is None:
                first = time.perf_counter() - started
            if delta:
                last = time.perf_counter() - started
            text.append(delta)
            if chunk.choices[0].finish_reason:
                final = chunk
        if chunk.usage is not None:
            usage = chunk.usage
    ended = time.perf_counter() - started
    cached = usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else None
    return {
        "client_ttft_s": round(first, 4) if first is not None else None,
        "client_total_s": round(ended, 4),
        "last_token_to_end_s": round(ended - last, 4) if last is not None else None,
        "answer": "".join(text).strip(),
        "prompt_tokens": usage.prompt_tokens,
        "cached_tokens": cached,
        "server_timings": final.model_extra["rag"]["timings"],
        "session_id": final.model_extra["session_id"],
        "shared": (final.model_extra["rag"].get("session") or {}).get("shared"),
    }


def _langchain_turn(chat, messages: list, max_tokens: int) -> dict:
    started = time.perf_counter()
    first = None
    text, usage, metadata = [], None, {}
    for chunk in chat.stream(messages):
        if chunk.content and first is None:
            first = time.perf_counter() - started
        text.append(chunk.content or "")
        usage = chunk.usage_metadata or usage
        metadata.update(chunk.response_metadata or {})
    details = (usage or {}).get("input_token_details", {})
    return {
        "client_ttft_s": round(first, 4) if first is not None else None,
        "answer": "".join(text).strip(),
        "prompt_tokens": (usage or {}).get("input_tokens"),
        "cached_tokens": details.get("cache_read"),
    }


def run_followup_bench(args: argparse.Namespace, progress: Callable[[str], None] = print) -> dict:
    import openai
    from langchain_core.messages import AIMessage, HumanMessage
    from langchain_openai import ChatOpenAI

    from ragkv.api.launcher import ServerProcess

    if args.dataset is None:
        raise SystemExit("ragkv serve followup needs --dataset (MuSiQue-style JSON: ctxs, question)")
    server = scratch = None
    base_url = args.url
    if base_url is None:
        scratch = tempfile.TemporaryDirectory(prefix="ragkv-followup-bench-")
        progress(f"starting ragkv serve over {scratch.name} ...")
        server = ServerProcess(["--data-dir", scratch.name]).start()
        base_url = server.url
    key = args.bench_key or "unused"
    results = {"server": base_url, "max_tokens": args.max_tokens, "clients": {}}
    try:
        samples = _samples(args.dataset, 2)
        with httpx.Client(base_url=base_url, headers={"Authorization": f"Bearer {key}"}, timeout=600) as http:
            documents = [_ingest(http, text, f"musique-{n}.txt") for n, (text, _) in enumerate(samples)]
        progress(f"ingested {[chunks for _, chunks in documents]} chunks")
        client = openai.OpenAI(base_url=base_url + "/v1", api_key=key, max_retries=0, timeout=600)

        (doc_id, chunks), (_, question) = documents[0], samples[0]
        rag = {"document_ids": [doc_id], "top_k": chunks}
        first = _openai_turn(client, [{"role": "user", "content": question}], rag, args.max_tokens)
        history = [
            {"role": "user", "content": question},
            {"role": "assistant", "content": first["answer"]},
            {"role": "user", "content": FOLLOW_UP},
        ]
        second = _openai_turn(client, history, rag, args.max_tokens)
        results["clients"]["openai"] = {"turn_1": first, "turn_2": second}
        progress(
            f"openai: turn 1 TTFT {first['client_ttft_s']} s ({first['prompt_tokens']} prompt tokens); turn 2 "
            f"TTFT {second['client_ttft_s']} s, {second['cached_tokens']} of {second['prompt_tokens']} cached"
        )

        (doc_id, chunks), (_, question) = documents[1], samples[1]
        chat = ChatOpenAI(
            model="ragkv",
            base_url=base_url + "/v1",
            api_key=key,
            max_tokens=args.max_tokens,
            temperature=0,
            max_retries=0,
            timeout=600,
            stream_usage=True,
            extra_body={"rag": {"document_ids": [doc_id], "top_k": chunks}},
        )
        first = _langchain_turn(chat, [HumanMessage(question)], args.max_tokens)
        second = _langchain_turn(
            chat, [HumanMessage(question), AIMessage(first["answer"]), HumanMessage(FOLLOW_UP)], args.max_tokens
        )
        results["clients"]["langchain"] = {"turn_1": first, "turn_2": second}
        progress(
            f"langchain: turn 1 TTFT {first['client_ttft_s']} s ({first['prompt_tokens']} prompt tokens); turn 2 "
            f"TTFT {second['client_ttft_s']} s, {second['cached_tokens']} of {second['prompt_tokens']} cached"
        )
    finally:
        if server is not None:
            server.stop()
        if scratch is not None:
            scratch.cleanup()
    for _name, turns in results["clients"].items():
        second = turns["turn_2"]
        second["cached_fraction"] = round(second["cached_tokens"] / second["prompt_tokens"], 4)
    return results
