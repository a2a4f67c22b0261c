#!/usr/bin/env bash
# The ragkv API with curl, step by step. Start a server first:
#
#     ragkv serve                        # http://127.0.0.1:8000, no API keys
#     # or, with keys:  echo '{"secret-key-alpha": "alpha"}' > keys.json && ragkv serve --api-keys keys.json
#
# then run this file (or paste its commands one at a time):
#
#     bash examples/curl_walkthrough.sh
#
# RAGKV_URL and RAGKV_API_KEY override the address and the key.
set -euo pipefail
cd "$(dirname "$0")"

URL=${RAGKV_URL:-http://127.0.0.1:8000}
AUTH=()
if [[ -n "${RAGKV_API_KEY:-}" ]]; then AUTH=(-H "Authorization: Bearer $RAGKV_API_KEY"); fi
say() { printf '\n\033[1m## %s\033[0m\n' "$*"; }

say "Health (open, no key): status ok, or degraded when Redis is gone"
curl -s "$URL/health"; echo

say "Ingest a file (multipart) with metadata"
curl -s "${AUTH[@]}" -F "file=@corpus/lighthouses.md" -F 'metadata={"source": "curl"}' "$URL/v1/documents"; echo

say "Ingest text (JSON)"
python3 -c 'import json,sys; print(json.dumps({"text": open("corpus/observatory.md").read(), "name": "observatory.md"}))' |
  curl -s "${AUTH[@]}" -H 'Content-Type: application/json' --data-binary @- "$URL/v1/documents"; echo
curl -s "${AUTH[@]}" -F "file=@corpus/orchard.txt" "$URL/v1/documents"; echo

say "A larger document in the background: 202 and a job"
JOB=$(python3 -c 'import json; print(json.dumps({"text": "\n".join(f"Log line {i}: calm sea, lamp lit." for i in range(150)), "name": "log.txt", "background": True}))' |
  curl -s "${AUTH[@]}" -H 'Content-Type: application/json' --data-binary @- "$URL/v1/documents")
echo "$JOB"
JOB_ID=$(echo "$JOB" | python3 -c 'import json,sys; print(json.load(sys.stdin)["job"]["id"])')
sleep 2
curl -s "${AUTH[@]}" "$URL/v1/jobs/$JOB_ID"; echo

say "List documents; show one"
curl -s "${AUTH[@]}" "$URL/v1/documents"; echo
DOC=$(curl -s "${AUTH[@]}" "$URL/v1/documents" | python3 -c 'import json,sys; print(json.load(sys.stdin)["data"][0]["id"])')
curl -s "${AUTH[@]}" "$URL/v1/documents/$DOC"; echo

say "Ask: answer, citations, usage (reused vs computed tokens), timings"
curl -s "${AUTH[@]}" -H 'Content-Type: application/json' "$URL/v1/query" \
  -d '{"question": "When was Gull Point Light first lit?", "top_k": 3, "strategy": "a3", "ratio": 0.15, "max_tokens": 32}'; echo

say "Ask, streamed as server-sent events"
curl -sN "${AUTH[@]}" -H 'Content-Type: application/json' "$URL/v1/query" \
  -d '{"question": "How tall is Stormhead Light?", "max_tokens": 24, "stream": true}'; echo

say "OpenAI-compatible chat, turn 1 (note session_id in the reply)"
REPLY=$(curl -s "${AUTH[@]}" -H 'Content-Type: application/json' "$URL/v1/chat/completions" \
  -d '{"model": "ragkv", "max_tokens": 32, "messages": [{"role": "user", "content": "Which lighthouse is red?"}], "rag": {"top_k": 3}}')
echo "$REPLY"
SESSION=$(echo "$REPLY" | python3 -c 'import json,sys; print(json.load(sys.stdin)["session_id"])')

say "Turn 2 in the same session, streamed: only the new message is computed"
curl -sN "${AUTH[@]}" -H 'Content-Type: application/json' "$URL/v1/chat/completions" \
  -d "{\"model\": \"ragkv\", \"max_tokens\": 32, \"stream\": true, \"session_id\": \"$SESSION\", \"messages\": [{\"role\": \"user\", \"content\": \"Why was its red sector added?\"}]}"; echo

say "Bad input gets a 4xx with a message"
curl -s "${AUTH[@]}" -H 'Content-Type: application/json' "$URL/v1/query" -d '{"question": "x", "strategy": "nope"}'; echo
curl -s "${AUTH[@]}" "$URL/v1/documents/doc_does_not_exist"; echo

say "Wait for the background job, delete its document; drop the session"
until curl -s "${AUTH[@]}" "$URL/v1/jobs/$JOB_ID" | grep -q '"status":"\(succeeded\|failed\)"'; do sleep 1; done
LOG_ID=$(curl -s "${AUTH[@]}" "$URL/v1/jobs/$JOB_ID" | python3 -c 'import json,sys; print(json.load(sys.stdin)["result"]["document"]["id"])')
curl -s "${AUTH[@]}" -X DELETE "$URL/v1/documents/$LOG_ID"; echo
curl -s "${AUTH[@]}" -X DELETE "$URL/v1/sessions/$SESSION"; echo

say "Prometheus metrics (excerpt)"
curl -s "$URL/metrics" | grep -E '^ragkv_(ttft_seconds_count|tokens_total|chunk_lookups_total|store_entries|degraded)' || true
