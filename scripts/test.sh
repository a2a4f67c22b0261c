#!/usr/bin/env bash
# Runs the whole test suite (Triton kernels under the CPU interpreter; tests start their
# own redis-server and uvicorn processes).
set -euo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
exec python3 -m pytest -q -p no:cacheprovider "$@"
