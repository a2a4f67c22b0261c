#!/usr/bin/env bash
# One vLLM replica with RagkvConnector over a shared chunk tier.
#   MODEL=/models/llama-3-8b-instruct STORE_URL=redis://cache:6379/0 PORT=8001 examples/vllm-connector/serve.sh
# Every replica runs this with the same MODEL (the same weights: chunk keys carry a fingerprint
# of them), STORE_URL and TENANT. PYTHON is the interpreter of the environment vLLM and
# ragkv[vllm] are installed in (scripts/install_vllm.sh makes a CPU one).
set -euo pipefail
: "${MODEL:?a Hugging Face model folder}"
PYTHON=${PYTHON:-python}
PORT=${PORT:-8000}
STORE_URL=${STORE_URL:-}            # empty: the data folder's LMDB ($RAGKV_HOME, else ~/.ragkv)
TENANT=${TENANT:-default}
STRATEGY=${STRATEGY:-probe}
extra=$(STORE_URL="$STORE_URL" TENANT="$TENANT" STRATEGY="$STRATEGY" "$PYTHON" -c '
import json, os
extra = {"tenant": os.environ["TENANT"], "strategy": os.environ["STRATEGY"]}
if os.environ["STORE_URL"]:
    extra["store_url"] = os.environ["STORE_URL"]
print(json.dumps({"kv_connector": "RagkvConnector", "kv_connector_module_path": "ragkv.vllm.connector",
                  "kv_role": "kv_both", "kv_connector_extra_config": extra}))')
# On CPU: vLLM reserves a core for a configured connector unless told otherwise, and its CPU
# attention reads one KV layout; the hybrid KV cache manager stays off (one attention group).
if ! "$PYTHON" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)'; then
    export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-4}
    export VLLM_CPU_OMP_THREADS_BIND=${VLLM_CPU_OMP_THREADS_BIND:-0-$(($(nproc) - 1))}
    export VLLM_CPU_NUM_OF_RESERVED_CPU=${VLLM_CPU_NUM_OF_RESERVED_CPU:-0}
fi
exec "$PYTHON" -m vllm.entrypoints.openai.api_server --model "$MODEL" --port "$PORT" \
    --disable-hybrid-kv-cache-manager --kv-transfer-config "$extra" "$@"
