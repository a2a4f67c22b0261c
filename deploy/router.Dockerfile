# The front door of the replicas profile: vllm-router (PyPI, a Rust binary in its wheel)
# with cache-aware routing, so a conversation's follow-up lands on the replica that holds
# its context instead of fetching it from Redis. Chosen over sglang-router 0.3.2, which did
# not come up in front of ragkv replicas (python -m ragkv.bench.router_bench).
FROM python:3.11-slim
ARG VLLM_ROUTER_VERSION=0.1.17
RUN pip install --no-cache-dir "vllm-router==${VLLM_ROUTER_VERSION}" \
 && useradd --system --uid 10002 router
USER router
ENTRYPOINT ["vllm-router"]
