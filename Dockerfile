# syntax=docker/dockerfile:1
# Two images from one file:
#   --target operator  slim: the kopf operator and CLI, no torch
#   --target runtime   CUDA: the Ray actors that run torch/diffusers/xfuser
# The runtime target is completed by the runtime issue (Ray, torch, xfuser).

FROM python:3.11-slim AS operator
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1
WORKDIR /src
COPY pyproject.toml README.md ./
COPY operator ./operator
COPY runtime ./runtime
RUN pip install . && python -c "import videojob, sys; assert 'torch' not in sys.modules"
USER 65532:65532
ENTRYPOINT ["videojob"]

FROM nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04 AS runtime
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 \
    DEBIAN_FRONTEND=noninteractive VIRTUAL_ENV=/opt/venv PATH=/opt/venv/bin:$PATH
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv ffmpeg \
 && rm -rf /var/lib/apt/lists/* \
 && python3 -m venv /opt/venv
WORKDIR /src
COPY pyproject.toml README.md ./
COPY operator ./operator
COPY runtime ./runtime
RUN pip install .
USER 65532:65532
ENTRYPOINT ["videojob"]
