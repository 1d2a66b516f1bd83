# syntax=docker/dockerfile:1
# Weir engine image (`weir engine serve`), in two variants chosen with a build argument:
#     docker build -f deploy/docker/engine.Dockerfile -t weir-engine:cpu .
#     docker build -f deploy/docker/engine.Dockerfile --build-arg VARIANT=cuda -t weir-engine:cuda .
# MODEL (default smollm2-135m) is pulled into the image at build time so a pod starts without
# network access; pass --build-arg MODEL= to build without one and mount models under WEIR_MODELS_DIR.

ARG PYTHON_VERSION=3.11
ARG VARIANT=cpu

FROM python:${PYTHON_VERSION}-slim-bookworm AS build-base
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PATH=/opt/weir/venv/bin:$PATH
RUN python -m venv /opt/weir/venv
WORKDIR /opt/weir/app
COPY pyproject.toml constraints.txt ./
COPY deploy/docker/requirements.py /tmp/requirements.py
RUN python /tmp/requirements.py pyproject.toml --only torch > /tmp/torch.txt \
 && python /tmp/requirements.py pyproject.toml --except torch > /tmp/requirements.txt

FROM build-base AS torch-cpu
RUN pip install --index-url https://download.pytorch.org/whl/cpu -r /tmp/torch.txt

# PyPI's Linux torch wheels bundle the CUDA runtime libraries (and pull in Triton); the driver comes
# from the host through the NVIDIA container toolkit.
FROM build-base AS torch-cuda
RUN pip install -r /tmp/torch.txt

FROM torch-${VARIANT} AS build
# Triton (about 1 GB: LLVM, ptxas) comes in with xgrammar, and with CUDA torch. The cuda image runs
# Weir's kernels on it (and fails to build without it); the cpu image never imports it (on the CPU the
# kernels take their PyTorch paths and xgrammar its C++ one), so it leaves it out.
ARG VARIANT
RUN pip install -c constraints.txt -r /tmp/requirements.txt \
 && if [ "$VARIANT" = cpu ]; then pip uninstall -y triton; else python -c "import triton"; fi
COPY . .
RUN pip install --no-deps -e . && python -m compileall -q engine kernels weir gateway routing
ARG MODEL=smollm2-135m
ENV WEIR_MODELS_DIR=/opt/weir/models
RUN mkdir -p "$WEIR_MODELS_DIR" && if [ -n "$MODEL" ]; then weir models pull "$MODEL"; fi

# A C compiler at run time: on the CPU the engine builds its fused decode step for the machine it runs
# on at load (kernels/cpu_decode.c, -march=native; without gcc it serves on the slower eager path), and
# on CUDA Triton compiles a small C launcher the first time it runs a kernel.
FROM python:${PYTHON_VERSION}-slim-bookworm AS runtime-cpu
RUN apt-get update \
 && apt-get install -y --no-install-recommends gcc libc6-dev \
 && rm -rf /var/lib/apt/lists/*

FROM runtime-cpu AS runtime-cuda
ENV NVIDIA_VISIBLE_DEVICES=all \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility

FROM runtime-${VARIANT} AS runtime
ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PATH=/opt/weir/venv/bin:$PATH \
    WEIR_MODELS_DIR=/opt/weir/models \
    HOME=/var/lib/weir
RUN groupadd --system --gid 10001 weir \
 && useradd --system --uid 10001 --gid weir --home-dir /var/lib/weir --create-home weir
COPY --from=build /opt/weir /opt/weir
WORKDIR /var/lib/weir
USER 10001:10001
EXPOSE 8000
# /health answers 200 only once the model is loaded, so this also covers a slow start.
HEALTHCHECK --interval=10s --timeout=3s --start-period=300s --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=2)"]
CMD ["weir", "engine", "serve", "--model", "smollm2-135m", "--host", "0.0.0.0", "--port", "8000"]
