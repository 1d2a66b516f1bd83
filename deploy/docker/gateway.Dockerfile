# syntax=docker/dockerfile:1
# Weir gateway image: stateless, so run as many replicas as the load needs behind any load balancer.
# Build from the repository root:
#     docker build -f deploy/docker/gateway.Dockerfile -t weir-gateway .
# Configuration comes from /etc/weir/weir.yaml (mount it) and WEIR_* environment variables; no
# secret is ever baked into the image.

ARG PYTHON_VERSION=3.11

FROM python:${PYTHON_VERSION}-slim-bookworm AS build
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PATH=/opt/weir/venv/bin:$PATH
RUN python -m venv /opt/weir/venv
WORKDIR /opt/weir/app
# Dependencies in their own layer, read from pyproject.toml, so a code change reuses it.
COPY pyproject.toml constraints.txt ./
COPY deploy/docker/requirements.py /tmp/requirements.py
# The gateway runs its difficulty classifier on CPU: the CPU build of torch is a fraction of the size.
# xgrammar (the engine's structured output) pulls in Triton, a GPU compiler of about 1 GB (LLVM, ptxas)
# that nothing on the gateway's CPU path imports (Weir's kernels and xgrammar treat it as optional).
RUN python /tmp/requirements.py pyproject.toml --only torch > /tmp/torch.txt \
 && python /tmp/requirements.py pyproject.toml --except torch > /tmp/requirements.txt \
 && pip install --index-url https://download.pytorch.org/whl/cpu -r /tmp/torch.txt \
 && pip install -c constraints.txt -r /tmp/requirements.txt \
 && pip uninstall -y triton
COPY . .
# Installed in place (editable) so alembic.ini, migrations/ and shipped data files sit where the code
# expects them, exactly as in a development checkout.
RUN pip install --no-deps -e . && python -m compileall -q gateway routing weir engine kernels migrations
# The static-table difficulty head (what `difficulty_head: auto` serves on CPUs too slow for the
# encoder) needs a table distilled from MiniLM: built here once (~30 s), not at every replica's start.
ENV WEIR_CACHE_DIR=/opt/weir/cache
RUN python -c "from routing.embed import StaticEmbedder; StaticEmbedder.from_minilm()"

FROM python:${PYTHON_VERSION}-slim-bookworm AS runtime
ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    WEIR_CACHE_DIR=/opt/weir/cache \
    PATH=/opt/weir/venv/bin:$PATH
RUN groupadd --system --gid 10001 weir \
 && useradd --system --uid 10001 --gid weir --home-dir /var/lib/weir --create-home weir \
 && mkdir -p /etc/weir
COPY --from=build /opt/weir /opt/weir
# The working directory holds what the gateway writes locally (the usage spool when Redis is not
# configured, a SQLite file when no database URL is given): mount a volume here in production.
WORKDIR /var/lib/weir
USER 10001:10001
EXPOSE 8080
HEALTHCHECK --interval=10s --timeout=3s --start-period=30s --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8080/readyz', timeout=2)"]
CMD ["weir", "serve", "--config", "/etc/weir/weir.yaml", "--host", "0.0.0.0", "--port", "8080"]
