"""`ragkv serve bench --target`: the workload each side gets and the client-side figures, against
a stand-in OpenAI-compatible server that streams its chunks at a known pace."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from ragkv.bench.peer_bench import PeerBenchConfig, run_peer_bench

CHUNK_GAP_S = 0.05


class StandIn(BaseHTTPRequestHandler):
    """/v1/documents (ids), /v1/models and streamed /v1/chat/completions: 4 chunks, 50 ms apart."""

    seen: list[dict] = []

    def _json(self, payload: dict, status: int = 200) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):  # noqa: N802 (http.server's name)
        self._json({"object": "list", "data": [{"id": "peer-model"}]})

    def do_POST(self):  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        StandIn.seen.append({"path": self.path, **body})
        if self.path == "/v1/documents":
            self._json({"document": {"id": f"doc-{body['name']}"}}, 201)
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        for piece in ("The", " answer", " is", " here"):
            chunk = {"choices": [{"index": 0, "delta": {"content": piece}}]}
            self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
            self.wfile.flush()
            time.sleep(CHUNK_GAP_S)
        self.wfile.write(b"data: [DONE]\n\n")

    def log_message(self, *args):
        pass


@pytest.fixture
def stand_in():
    StandIn.seen = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), StandIn)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_both_sides_get_the_same_questions_and_passages_and_are_timed_at_the_client(stand_in, tmp_path):
    examples = [
        {
            "question": f"Question {n}?",
            "answers": ["x"],
            "ctxs": [{"title": f"T{n}{i}", "text": f"Passage {i} of example {n}."} for i in range(3)],
        }
        for n in range(14)
    ]
    data = tmp_path / "dev.json"
    data.write_text(json.dumps(examples))
    # levels of 4, 4 and 6 requests (at least 4 each): 14 prompts, as many as there are examples
    config = PeerBenchConfig(data, examples=14, passages=2, clients=(1, 4, 6), max_tokens=8)
    result = run_peer_bench(stand_in, stand_in, config, progress=lambda line: None)

    ingested = [seen for seen in StandIn.seen if seen["path"] == "/v1/documents"]
    assert len(ingested) == 28 and ingested[0]["text"] == "T00\nPassage 0 of example 0."
    chats = [seen for seen in StandIn.seen if seen["path"] == "/v1/chat/completions"]
    ours = [c for c in chats if c["model"] == "ragkv" and c.get("rag", {}).get("enabled", True)]
    theirs = [c for c in chats if c["model"] == "peer-model" and c["max_tokens"] == 8]
    assert len(ours) == len(theirs) == 14  # warm-ups apart
    for body in ours:
        n = int(body["messages"][0]["content"].split()[1].rstrip("?"))
        assert body["rag"]["document_ids"] == [f"doc-peer-bench-{n}-{i}.txt" for i in range(2)]
    for body in theirs:
        prompt = body["messages"][-1]["content"]
        n = int(prompt.rsplit("Question ", 1)[1].rstrip("?"))
        assert f"Passage 0 of example {n}." in prompt and f"Passage 1 of example {n}." in prompt
        assert "Passage 2" not in prompt and body["temperature"] == 0 and body["stream"]
    asked = [c["messages"][-1]["content"] for c in theirs]
    assert len(set(asked)) == 14  # no prompt repeats across levels: no prompt cache can flatter either side
    assert len({body["messages"][0]["content"] for body in ours}) == 14
    for row in result["levels"]:
        for side in ("ragkv", "target"):
            figures = row[side]
            assert figures["errors"] == 0 and figures["requests"] == max(4, row["clients"])
            assert 0.8 * CHUNK_GAP_S * 1000 <= figures["decode_ms_per_token"] <= 3 * CHUNK_GAP_S * 1000
            assert figures["ttft_p50_s"] < figures["latency_p50_s"]
    assert result["target_model"] == "peer-model"


def test_the_pasted_workload_sends_the_same_prompts_to_both_sides_cold_then_shuffled(stand_in, tmp_path):
    from ragkv.bench.pasted_peer_bench import run_pasted_bench

    examples = [
        {
            "question": f"Question {n}?",
            "answers": ["x"],
            "ctxs": [{"title": "", "text": f"Passage {i} of example {n}."} for i in range(5)],
        }
        for n in range(3)
    ]
    data = tmp_path / "dev.json"
    data.write_text(json.dumps(examples))
    config = PeerBenchConfig(data, examples=3, passages=5, clients=(1, 2), max_tokens=8)
    result = run_pasted_bench(stand_in, [stand_in], config, progress=lambda line: None)

    chats = [seen for seen in StandIn.seen if seen["path"] == "/v1/chat/completions" and seen["max_tokens"] == 8]
    # full prefill (3), cold (3 + 3), shuffled (3 + 3), 2 clients (3 + 3); nothing is ingested
    assert len(chats) == 21 and not [seen for seen in StandIn.seen if seen["path"] == "/v1/documents"]

    def passages(body: dict) -> list[str]:
        return body["messages"][1]["content"].split("Documents:\n")[1].split("\n\nQuestion:")[0].split("\n\n")

    full, cold, shuffled = chats[0:3], chats[3:9], chats[9:15]
    assert all(body["prompt_spans"] is False for body in full)
    original = [f"Passage {i} of example 0." for i in range(5)]
    assert passages(full[0]) == original[::-1]
    assert passages(cold[0]) == passages(cold[3]) == original  # ragkv's, then the target's
    assert passages(shuffled[0]) == passages(shuffled[3]) != original
    assert sorted(passages(shuffled[0])) == sorted(original)
    assert all("prompt_spans" not in body for body in cold + shuffled)
    assert set(result["passes"]) == {"ragkv_full_prefill", "cold", "shuffled"}
    assert result["levels"][0]["clients"] == 2 and result["ratios"]["shuffled_ttft_target1_over_ragkv"] > 0
