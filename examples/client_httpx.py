#!/usr/bin/env python
"""The document and query API with plain httpx, against a running `ragkv serve`.

    ragkv serve &
    python examples/client_httpx.py

Environment: RAGKV_URL (default http://127.0.0.1:8000), RAGKV_API_KEY (when the server
has --api-keys). Ingests examples/corpus (a multipart upload; re-running is a no-op since
identical text is recognised), ingests a larger document as a background job and follows
its progress, asks a question (JSON answer, then streamed as server-sent events), and
deletes the background document again.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import httpx

CORPUS = Path(__file__).resolve().parent / "corpus"
headers = {"Authorization": f"Bearer {os.environ['RAGKV_API_KEY']}"} if os.environ.get("RAGKV_API_KEY") else {}
http = httpx.Client(base_url=os.environ.get("RAGKV_URL", "http://127.0.0.1:8000"), headers=headers, timeout=300)

print("health:", http.get("/health").json()["status"])

# 1. Upload files (multipart); metadata is any JSON object.
for path in sorted(CORPUS.iterdir()):
    with open(path, "rb") as handle:
        response = http.post("/v1/documents", files={"file": (path.name, handle, "text/plain")},
                             data={"metadata": json.dumps({"source": "examples/corpus"})})
    response.raise_for_status()
    body = response.json()
    print(f"{body['document']['id']}  {path.name}: {body['ingest']['computed_chunks']} chunk(s) computed")

# 2. A larger document ingests in the background: 202 + a job to poll.
text = "\n\n".join(f"Keeper's log, night {n}: wind {['N', 'E', 'S', 'W'][n % 4]} force {n % 9}, lamp lit at dusk, "
                   f"{n % 5} ships sighted, oil used {n * 3} litres." for n in range(120))
response = http.post("/v1/documents", json={"text": text, "name": "keepers-log.txt", "background": True})
job = response.json()["job"]
print(f"\nbackground job {job['id']}: {response.status_code}")
while job["status"] in ("queued", "running"):
    time.sleep(0.5)
    job = http.get(f"/v1/jobs/{job['id']}").json()
    print(f"  {job['status']}: {job['progress']['chunks_done']}/{job['progress']['chunks_total']} chunks")
log_id = job["result"]["document"]["id"]

print("\ndocuments:", [doc["name"] for doc in http.get("/v1/documents").json()["data"]])

# 3. A question, answered as JSON ...
answer = http.post("/v1/query", json={"question": "What is Kestrel Bay Light's colour, and why?", "top_k": 3,
                                      "strategy": "probe", "ratio": 0.1, "max_tokens": 48}).json()
print(f"\nanswer: {answer['answer']}")
for citation in answer["citations"]:
    print(f"  {citation['name']} chunk {citation['chunk_index']} [{citation['char_start']}:{citation['char_end']}] "
          f"score {citation['score']:.3f}")
print("  usage:", answer["usage"])
print("  timings:", answer["timings"])

# ... and streamed (server-sent events: retrieval, token..., done, [DONE]).
print("\nstreamed: ", end="")
with http.stream("POST", "/v1/query", json={"question": "How long did Margarethe Olsen keep the light?",
                                            "max_tokens": 48, "stream": True}) as stream:
    for line in stream.iter_lines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        event = json.loads(line[6:])
        if event["type"] == "token":
            print(event["text"], end="", flush=True)
        elif event["type"] == "done":
            print(f"\n  TTFT {event['timings']['ttft']:.3f} s, decode {event['timings']['decode']:.3f} s")
        elif "error" in event:
            print("\n  error:", event["error"]["message"])

# 4. Delete the background document.
print("\ndeleted:", http.delete(f"/v1/documents/{log_id}").json())
