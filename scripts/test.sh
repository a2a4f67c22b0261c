#!/usr/bin/env bash
# Runs the whole test suite (Triton kernels under the CPU interpreter; tests start their
# own redis-server and uvicorn processes).
set -euo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
# Triton kernels run in the CPU interpreter for the whole run: a test module that sets this
# at import is too late once another module has imported triton. "auto" never picks
# Triton for CPU tensors, so only the tests that force it use the interpreter.
export TRITON_INTERPRET=1
exec python3 -m pytest -q -p no:cacheprovider "$@"
