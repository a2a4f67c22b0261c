#!/usr/bin/env bash
# vllm-router (PyPI: a Rust binary in its wheel), the cache-aware front door of several ragkv
# replicas, in a venv of its own; prints the binary's path (what `ragkv serve followup
# --replicas --router BIN` and deploy/router.Dockerfile run).
#   scripts/install_router.sh [VENV]    default $RAGKV_ROUTER_ENV, else ~/.cache/ragkv-router/venv
set -euo pipefail
version=0.1.17  # the version deploy/router.Dockerfile pins
venv=${1:-${RAGKV_ROUTER_ENV:-$HOME/.cache/ragkv-router/venv}}
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
if ! "$venv/bin/pip" show vllm-router 2>/dev/null | grep -qx "Version: $version"; then
    "$venv/bin/pip" install -q "vllm-router==$version"
fi
echo "$venv/bin/vllm-router"
