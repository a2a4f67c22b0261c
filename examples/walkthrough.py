#!/usr/bin/env python
"""The whole story in one command:

    python examples/walkthrough.py

1. starts `ragkv serve` on its defaults (127.0.0.1:8000, data in $RAGKV_HOME or ~/.ragkv;
   another free port if 8000 is taken),
2. ingests examples/corpus through POST /v1/documents,
3. asks three questions on POST /v1/query with the default fused strategy (probe) and with
   strategy `full` (plain prefill of the whole prompt), printing the answers, their
   citations and the TTFT of each,
4. holds a two-turn chat on /v1/chat/completions to show turn 2 reusing turn 1's KV,
5. stops the server.

Options: --scratch uses a throwaway data folder instead of the default one;
--url http://HOST:PORT talks to a server that is already running (nothing is started).
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

CORPUS = Path(__file__).resolve().parent / "corpus"
QUESTIONS = [
    "When was Gull Point Light first lit, and what did it burn?",
    "What is the main instrument of Hallerberg Observatory?",
    "Which apple variety did Linden Hill Orchard find by chance, and when?",
]


def port_free(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) != 0


def start_server(scratch: str | None) -> tuple[subprocess.Popen, str]:
    port = 8000
    if not port_free(port):
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        print(f"port 8000 is taken; using {port}")
    command = [sys.executable, "-c", "import sys; from ragkv.cli import main; sys.exit(main())", "serve", "--port", str(port)]
    if scratch:
        command += ["--data-dir", scratch]
    print("$ ragkv serve" + (f" --port {port}" if port != 8000 else "") + (f" --data-dir {scratch}" if scratch else ""))
    server = subprocess.Popen(command)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise SystemExit(f"ragkv serve exited with {server.returncode}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return server, url
        except httpx.HTTPError:
            time.sleep(0.5)
    server.kill()
    raise SystemExit("ragkv serve did not start within 300 s")


def short(text: str, width: int = 90) -> str:
    text = " ".join(text.split())
    return text if len(text) <= width else text[: width - 3] + "..."


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scratch", action="store_true", help="use a throwaway data folder")
    parser.add_argument("--url", default=None, help="use a running server instead of starting one")
    parser.add_argument("--max-tokens", type=int, default=32)
    args = parser.parse_args()
    headers = {"Authorization": f"Bearer {os.environ['RAGKV_API_KEY']}"} if os.environ.get("RAGKV_API_KEY") else {}

    scratch = tempfile.TemporaryDirectory(prefix="ragkv-walkthrough-") if args.scratch else None
    server, url = (None, args.url) if args.url else start_server(scratch.name if scratch else None)
    try:
        with httpx.Client(base_url=url, headers=headers, timeout=600) as http:
            print(f"\nserver {url}: {http.get('/health').json()['status']}")

            print("\n== ingest examples/corpus through POST /v1/documents")
            for path in sorted(CORPUS.iterdir()):
                body = http.post("/v1/documents", json={"text": path.read_text(), "name": path.name}).json()
                doc, ingest = body["document"], body["ingest"]
                note = " (already there)" if ingest["duplicate_of_existing"] else ""
                print(f"  {doc['id']}  {path.name}: {doc['tokens']} tokens, {doc['chunks']} chunk(s), "
                      f"{ingest['computed_chunks']} computed in {ingest['seconds']:.2f} s{note}")

            print("\n== questions on POST /v1/query: fused (probe, 10% recomputed) vs full prefill")
            totals = {"probe": 0.0, "full": 0.0}
            for question in QUESTIONS:
                print(f"\nQ: {question}")
                for strategy in ("probe", "full"):
                    answer = http.post("/v1/query", json={"question": question, "strategy": strategy, "top_k": 3,
                                                          "max_tokens": args.max_tokens})
                    answer.raise_for_status()
                    answer = answer.json()
                    totals[strategy] += answer["timings"]["ttft"]
                    usage = answer["usage"]
                    print(f"  [{strategy:>5}] TTFT {answer['timings']['ttft']:.3f} s "
                          f"({usage['cached_tokens']} prompt tokens cached, {usage['computed_tokens']} computed): "
                          f"{short(answer['answer'])}")
                    if strategy == "probe":
                        for number, citation in enumerate(answer["citations"], start=1):
                            print(f"         [{number}] {citation['name']} chunk {citation['chunk_index']} "
                                  f"chars {citation['char_start']}-{citation['char_end']} (score {citation['score']:.3f}): "
                                  f"{short(citation['text'], 60)}")
            print(f"\nmean TTFT: fused probe {totals['probe'] / len(QUESTIONS):.3f} s vs full prefill "
                  f"{totals['full'] / len(QUESTIONS):.3f} s ({totals['full'] / max(totals['probe'], 1e-9):.1f}x)")

            print("\n== a chat on POST /v1/chat/completions, the whole history resent (no session id)")
            history = [{"role": "user", "content": "How tall is Stormhead Light?"}]
            first = http.post("/v1/chat/completions", json={
                "model": "ragkv", "max_tokens": args.max_tokens, "messages": history}).json()
            history += [{"role": "assistant", "content": first["choices"][0]["message"]["content"]},
                        {"role": "user", "content": "How often did supplies reach it?"}]
            second = http.post("/v1/chat/completions", json={
                "model": "ragkv", "max_tokens": args.max_tokens, "messages": history}).json()
            for turn, reply in ((1, first), (2, second)):
                print(f"  turn {turn}: TTFT {reply['rag']['timings']['ttft']:.3f} s, {reply['usage']['prompt_tokens']} "
                      f"prompt tokens ({reply['usage']['computed_tokens']} computed): "
                      f"{short(reply['choices'][0]['message']['content'])}")
            print(f"  turn 2 TTFT is {second['rag']['timings']['ttft'] / first['rag']['timings']['ttft']:.0%} of turn 1's")
    finally:
        if server is not None:
            server.send_signal(signal.SIGINT)
            server.wait(30)
            print("\nserver stopped")
        if scratch is not None:
            scratch.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
