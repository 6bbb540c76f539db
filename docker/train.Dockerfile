# syntax=docker/dockerfile:1
# The NextStep training/export image: PyTorch (CPU build) plus the `train` extra.
# Build from the repository root:  docker build -f docker/train.Dockerfile -t nextstep-train .
# Data sets are mounted read-only at /data, artifacts are written to /artifacts:
#   docker run --rm --user "$(id -u):$(id -g)" -v /path/to/data:/data:ro -v "$PWD/artifacts:/artifacts" \
#     nextstep-train train deep_gpcm --data /data/kt/deepgpcm_synthetic_500_200_4 --out /artifacts/deep_gpcm/1
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_ROOT_USER_ACTION=ignore \
    MPLCONFIGDIR=/tmp/matplotlib \
    NEXTSTEP_DATA_DIR=/data

WORKDIR /app

COPY pyproject.toml constraints.txt README.md ./
COPY nextstep ./nextstep
COPY configs ./configs
# torch first, from the CPU wheel index (PyPI's torch is the multi-GB CUDA build), at the pinned version;
# then the rest of the train extra from PyPI, pinned, which keeps the torch already installed.
RUN pip install --index-url https://download.pytorch.org/whl/cpu -c constraints.txt torch \
    && pip install -c constraints.txt '.[train,serve,client]'  # (serve, client: nextstep retrain)

RUN groupadd --system --gid 10001 nextstep \
    && useradd --system --uid 10001 --gid nextstep --create-home --home-dir /home/nextstep \
       --shell /usr/sbin/nologin nextstep \
    && mkdir -p /data /artifacts \
    && chown nextstep:nextstep /artifacts
USER nextstep:nextstep

ENTRYPOINT ["nextstep"]
CMD ["--help"]
