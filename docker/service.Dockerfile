# syntax=docker/dockerfile:1
# The NextStep service image: ONNX Runtime + FastAPI only (the `serve` extra), no torch.
# Build from the repository root:  docker build -f docker/service.Dockerfile -t nextstep-api .
# Run it with trained artifacts mounted at /artifacts (read-only is enough):
#   docker run -p 8000:8000 -v "$PWD/artifacts:/artifacts:ro" nextstep-api
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_ROOT_USER_ACTION=ignore

WORKDIR /app

# Only what the package needs to install: metadata, pins, the package itself.
COPY pyproject.toml constraints.txt README.md ./
COPY nextstep ./nextstep
RUN pip install -c constraints.txt '.[serve]'

# An unprivileged user; the service only reads /artifacts and talks to Redis over the network.
RUN groupadd --system --gid 10001 nextstep \
    && useradd --system --uid 10001 --gid nextstep --create-home --home-dir /home/nextstep \
       --shell /usr/sbin/nologin nextstep \
    && mkdir -p /artifacts
USER nextstep:nextstep

# Settings are NEXTSTEP_* variables (nextstep/service/settings.py); pass NEXTSTEP_REDIS_URL,
# NEXTSTEP_API_KEYS, ... at run time. Without NEXTSTEP_REDIS_URL the state lives in the process.
ENV NEXTSTEP_ARTIFACTS_DIR=/artifacts

EXPOSE 8000

# /healthz answers as soon as the process serves (readiness, /readyz, also needs Redis and a model).
HEALTHCHECK --interval=10s --timeout=3s --start-period=30s --retries=3 \
    CMD ["python", "-c", "import sys, urllib.request; sys.exit(urllib.request.urlopen('http://127.0.0.1:8000/healthz', timeout=2).status != 200)"]

# `nextstep serve` exits at start when /artifacts holds no <model>/<version>/manifest.json, unless
# NEXTSTEP_DEMO=true (as docker/compose.yaml sets by default): then it serves the demo models bundled in
# the package (nextstep/demo_artifacts, ONNX only).
CMD ["nextstep", "serve", "--host", "0.0.0.0", "--port", "8000"]
