# syntax=docker/dockerfile:1.7
# Two images from one file, the chart's image.operator and image.runtime
# (charts/videojob/values.yaml), tagged with the package version, which is the
# chart's appVersion and so its default image tag:
#   docker build --target operator -t videojob/operator:0.1.0 .
#   docker build --target runtime  -t videojob/runtime:0.1.0 .
#
# operator  slim: the kopf operator and the CLI with pyproject.toml's base
#           dependencies only (no torch, no Ray: it speaks to Ray over HTTP).
#           Used in the chart's `address` and `kuberay` modes.
# runtime   CUDA: torch, diffusers, xfuser and Ray (the `runtime` extra). The
#           Ray head, workers and autoscaler of the chart's RayCluster (KubeRay
#           runs `ray start` in it), the per-job driver, and the operator pod
#           of `embedded` mode (Ray inside it).
#
# How versions are chosen (bump by hand, together):
# - Base images are pinned to exact tags down to the patch level. For
#   byte-for-byte rebuilds add the digest (`@sha256:...`, from
#   `docker buildx imagetools inspect <tag>`).
#   * python:3.11.17-slim-trixie: the Python minor the project is developed
#     and tested on (3.11, see .venv), at its latest patch.
#   * nvidia/cuda:13.0.2-base-ubuntu24.04: the CUDA that PyPI's torch 2.13.0
#     Linux wheel is built for (torch.version.cuda 13.0; its nvidia-cuda-runtime
#     13.0.96 is CUDA 13.0 Update 2). The `base` flavour, because that wheel
#     brings its own CUDA user-space libraries (cuBLAS, cuDNN, NCCL... as
#     nvidia-* wheels): a cudnn/runtime flavour would ship them twice. Nodes
#     need an NVIDIA driver that supports CUDA 13.0 (580 or newer).
#   * ghcr.io/astral-sh/uv:0.13.9: puts the same CPython patch as the operator
#     image (python-build-standalone) into the CUDA image, whose Ubuntu 24.04
#     has only Python 3.12; Ray wants one Python minor across head, workers and
#     drivers, and the tests run on 3.11.
# - Python packages come from PyPI's default index, as pyproject.toml states
#   them: the runtime extra pins torch==2.13.0 (the version in the dev venv;
#   PyPI's Linux wheel of it is the CUDA 13.0 build, so no extra index URL),
#   ray[default]==2.60.0 (the chart's ray.kuberay.rayVersion), diffusers,
#   xfuser and yunchang exactly; everything else resolves within
#   pyproject.toml's ranges at build time.
# - No system ffmpeg: mp4s are encoded with PyAV (runtime/videojob_runtime/
#   mp4encode.py), whose wheel bundles FFmpeg and libx264.

FROM python:3.11.17-slim-trixie AS wheel
# The videojob wheel (both source roots, operator/ and runtime/), built once for
# both images; the images mount it, so no source tree stays in them.
WORKDIR /src
COPY pyproject.toml README.md ./
COPY operator ./operator
COPY runtime ./runtime
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /wheels .

FROM ghcr.io/astral-sh/uv:0.13.9 AS uv

FROM python:3.11.17-slim-trixie AS operator
ARG VERSION=0.1.0
LABEL org.opencontainers.image.title="videojob-operator" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.description="VideoJob operator (kopf): no torch, no Ray"
ENV PYTHONUNBUFFERED=1 PIP_DISABLE_PIP_VERSION_CHECK=1
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
# The wheel without extras: pyproject.toml's base dependencies only. The check
# fails the build if torch or ray got in anyway (tests/test_dockerfile.py checks
# the same split against the dev venv).
RUN --mount=type=bind,from=wheel,source=/wheels,target=/wheels \
    pip install --no-cache-dir /wheels/videojob-*.whl \
 && python -c "import importlib.util as u, videojob.cli; bad = [m for m in ('torch', 'ray') if u.find_spec(m)]; assert not bad, bad" \
 && groupadd --gid 65532 videojob \
 && useradd --no-log-init --uid 65532 --gid 65532 --create-home --home-dir /home/videojob \
      --shell /usr/sbin/nologin videojob
# Set after the installs, which ran as root (and compiled the .pyc files).
ENV HOME=/home/videojob PYTHONDONTWRITEBYTECODE=1
WORKDIR /home/videojob
USER 65532:65532
ENTRYPOINT ["videojob"]
CMD ["--help"]

FROM nvidia/cuda:13.0.2-base-ubuntu24.04 AS runtime
ARG VERSION=0.1.0
ARG PYTHON_VERSION=3.11.17
LABEL org.opencontainers.image.title="videojob-runtime" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.description="VideoJob runtime: CUDA torch, diffusers, xfuser, Ray"
# UV_COMPILE_BYTECODE: the chart runs it with a read-only root filesystem, so
# .pyc files are written at build time or never.
ENV PYTHONUNBUFFERED=1 DEBIAN_FRONTEND=noninteractive \
    UV_PYTHON_INSTALL_DIR=/opt/python UV_PYTHON_BIN_DIR=/opt/python/bin \
    UV_PYTHON_PREFERENCE=only-managed UV_NO_CACHE=1 UV_COMPILE_BYTECODE=1 UV_LINK_MODE=copy \
    VIRTUAL_ENV=/opt/venv PATH=/opt/venv/bin:$PATH
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
# wget: KubeRay's liveness and readiness probes of Ray pods run
# `bash -c "wget ... http://localhost:52365/api/local_raylet_healthz"`
# (ray-operator v1.5.0, controllers/ray/common/pod.go); bash is in the base.
# Non-root user 65532 (as the chart's podSecurityContext) with a writable HOME
# (Ray writes ~/.ray, Hugging Face and Triton ~/.cache; the chart points HOME
# at its /tmp emptyDir instead, the root filesystem being read-only there).
RUN apt-get update \
 && apt-get install -y --no-install-recommends wget \
 && rm -rf /var/lib/apt/lists/* \
 && groupadd --gid 65532 videojob \
 && useradd --no-log-init --uid 65532 --gid 65532 --create-home --home-dir /home/videojob \
      --shell /bin/bash videojob
# CPython, a venv on PATH (`python`, `ray`, `videojob`: what KubeRay, the
# operator's driver entrypoint (operator.settings.driverPython) and the chart's
# embedded mode call), and the wheel with the runtime extra. The check fails
# the build on a CPU-only torch or a missing piece.
RUN --mount=type=bind,from=uv,source=/uv,target=/usr/local/bin/uv \
    --mount=type=bind,from=wheel,source=/wheels,target=/wheels \
    wheels=(/wheels/videojob-*.whl) \
 && uv python install "${PYTHON_VERSION}" \
 && uv venv --python "${PYTHON_VERSION}" "${VIRTUAL_ENV}" \
 && uv pip install --python "${VIRTUAL_ENV}/bin/python" "videojob[runtime] @ file://${wheels[0]}" \
 && python -c "import torch, ray, av, diffusers, videojob_runtime.driver; \
assert (torch.version.cuda or '').startswith('13.0'), torch.version.cuda; \
av.codec.Codec('libx264', 'w')" \
 && ray --version && videojob --help >/dev/null
# Set after the installs, which ran as root.
ENV HOME=/home/videojob PYTHONDONTWRITEBYTECODE=1
WORKDIR /home/videojob
USER 65532:65532
ENTRYPOINT ["videojob"]
CMD ["--help"]
