"""A published chat context in 16 bits or in int8 codes: what the cross-replica fetch costs
and what the codes change in a follow-up's first token.

    python -m ragkv.bench.context_codes_bench --dataset musique_dev.json [--samples 4] [--json out.json]

For each MuSiQue sample: turn 1 (its passages and question in one user message, a short
answer) is prefilled into a cache in the engine's KV dtype; that context is encoded both
ways, and for each way the blob is written to and read back from a real redis-server and
decoded (the fetch a follow-up on another replica pays), then the follow-up's own tokens
are prefilled onto the decoded context. Reported per way: blob bytes, SET, GET and decode
milliseconds (median of 5), and KL(16-bit || int8) of the follow-up's first-token
distribution with whether the greedy token agrees.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

FOLLOW_UP = "Can you say that in one short sentence?"
ANSWER = "The answer is given in the passages above."


def _timed(action, repeats: int = 5):
    times, result = [], None
    for _ in range(repeats):
        started = time.perf_counter()
        result = action()
        times.append(time.perf_counter() - started)
    return result, round(statistics.median(times) * 1000, 2)


def run(dataset: Path, samples: int) -> dict:
    import redis

    from ragkv.app.chat.context_blob import decode_context, encode_context
    from ragkv.app.chat.contexts import Context
    from ragkv.app.chat.conversation import continue_conversation, render_conversation
    from ragkv.bench.followup_bench import _samples
    from ragkv.bench.redis_process import RedisServer
    from ragkv.engine import Engine, EngineConfig

    engine = Engine(EngineConfig())
    model, prompt = engine.model, engine.prompt
    server = RedisServer()
    server.start()
    client = redis.Redis.from_url(server.url)
    rows = []
    try:
        for text, question in _samples(dataset, samples):
            turn = render_conversation(prompt, [{"role": "user", "content": f"{text}\n\nQuestion: {question}"}])
            ids = turn.token_ids + prompt.encode(ANSWER)
            cache = model.new_cache(len(ids))
            with torch.inference_mode():
                model.prefill(torch.tensor(ids), cache)
            context = Context("bench", "t", engine.fingerprint, ids, ids, cache)
            tail = continue_conversation(prompt, ids, FOLLOW_UP).token_ids[len(ids) :]
            row = {"context_tokens": len(ids), "kv_dtype": str(cache.dtype).removeprefix("torch.")}
            logits = {}
            for codes in ("16bit", "int8"):
                blob, encode_ms = _timed(lambda codes=codes, context=context: encode_context(context, kv_codes=codes))
                _, set_ms = _timed(lambda blob=blob: client.set("bench", blob))
                fetched, get_ms = _timed(lambda: client.get("bench"))
                loaded, decode_ms = _timed(lambda fetched=fetched: decode_context(bytearray(fetched)))
                follow = loaded.cache.clone(extra_capacity=len(tail))
                with torch.inference_mode():
                    logits[codes] = model.prefill(torch.tensor(tail), follow).float()
                row[codes] = {
                    "bytes": len(blob),
                    "encode_ms": encode_ms,
                    "set_ms": set_ms,
                    "get_ms": get_ms,
                    "decode_ms": decode_ms,
                    "fetch_ms": round(get_ms + decode_ms, 2),
                }
            reference, coded = logits["16bit"].log_softmax(-1), logits["int8"].log_softmax(-1)
            row["first_token_kl"] = float((reference.exp() * (reference - coded)).sum())
            row["same_greedy_token"] = bool(reference.argmax() == coded.argmax())
            rows.append(row)
            print(json.dumps(row), flush=True)
    finally:
        client.close()
        server.cleanup()
    kls = [row["first_token_kl"] for row in rows]
    return {
        "samples": rows,
        "mean_first_token_kl": statistics.mean(kls),
        "max_first_token_kl": max(kls),
        "same_greedy_token": sum(row["same_greedy_token"] for row in rows),
        "bytes_ratio": statistics.mean(row["int8"]["bytes"] / row["16bit"]["bytes"] for row in rows),
        "fetch_ms_16bit": statistics.mean(row["16bit"]["fetch_ms"] for row in rows),
        "fetch_ms_int8": statistics.mean(row["int8"]["fetch_ms"] for row in rows),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dataset", type=Path, required=True)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    results = run(args.dataset, args.samples)
    print(json.dumps({k: v for k, v in results.items() if k != "samples"}, indent=2))
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
