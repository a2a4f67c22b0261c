#!/usr/bin/env bash
# Runs the whole test suite (Triton kernels under the CPU interpreter; tests start their
# own redis-server and uvicorn processes), after the style gate (ruff lint and format).
#   scripts/test.sh                      the style gate, then every test (what CI runs)
#   scripts/test.sh tests/test_x.py -x   only the given tests, no style gate
#   RAGKV_TEST_SEED=N scripts/test.sh    replays the order of a run that printed seed N
# Test modules run in a shuffled order, and the tests inside each module too, so a test
# that only passes after another one fails somewhere; the seed is printed to replay it.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "$#" -eq 0 ]; then
    python3 -m ruff check ragkv tests
    python3 -m ruff format --check ragkv tests
fi
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
# Triton kernels run in the CPU interpreter for the whole run: a test module that sets this
# at import is too late once another module has imported triton. "auto" never picks
# Triton for CPU tensors, so only the tests that force it use the interpreter.
export TRITON_INTERPRET=1
seed="${RAGKV_TEST_SEED:-$(python3 -c 'import random; print(random.randrange(1, 10**6))')}"
echo "test order seed: $seed (replay: RAGKV_TEST_SEED=$seed scripts/test.sh ...)"
exec python3 -m pytest -q -p no:cacheprovider -p random_order \
    --random-order-bucket=module --random-order-seed="$seed" "$@"
