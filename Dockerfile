# warmfleet's two images, built from one wheel:
#
#   docker build --target engine -t ghcr.io/warmfleet/warmfleet:0.1.0 .        # warmfleet server pods (Paddle GPU)
#   docker build --target slim   -t ghcr.io/warmfleet/warmfleet-slim:0.1.0 .   # operator, router, EPP, fetch-model
#
# PyPI's `paddlepaddle-gpu` stops at 2.6, so the engine's GPU runtime comes from Paddle's own image (or wheel
# index: https://www.paddlepaddle.org.cn/packages/stable/cu126/). A CPU-only engine image (tests, demos):
#   --target engine --build-arg ENGINE_BASE=python:3.11-slim --build-arg ENGINE_EXTRA=engine
# The install and smoke steps are scripts/image-steps.sh, which CI also runs into fresh environments.
ARG ENGINE_BASE=paddlepaddle/paddle:3.0.0-gpu-cuda12.6-cudnn9.5-trt10.5
ARG SLIM_BASE=python:3.11-slim

# ---- the wheel, built from the package folders only ----
FROM ${SLIM_BASE} AS wheel
ENV PYTHONDONTWRITEBYTECODE=1 PIP_NO_CACHE_DIR=1
WORKDIR /src
COPY pyproject.toml setup.py MANIFEST.in README.md LICENSE ./
COPY warmfleet ./warmfleet
COPY server ./server
COPY operator ./operator
RUN python -m pip install --quiet build && python -m build --wheel --outdir /dist .

# ---- slim: python:3.11-slim + warmfleet[router,operator,fetch,gateway,tracing], no Paddle ----
FROM ${SLIM_BASE} AS slim
ENV PYTHONDONTWRITEBYTECODE=1 PIP_NO_CACHE_DIR=1 WARMFLEET_LOG_FORMAT=json
COPY scripts/image-steps.sh /usr/local/bin/warmfleet-image-steps
RUN --mount=type=bind,from=wheel,source=/dist,target=/dist \
    PYTHON=python warmfleet-image-steps slim /dist
# Non-root by default; the operator's and the chart's pod specs also set runAsNonRoot.
RUN useradd --uid 10001 --create-home --shell /usr/sbin/nologin warmfleet
USER 10001:10001
EXPOSE 8000
ENTRYPOINT ["warmfleet"]
CMD ["route", "--help"]

# ---- engine: the Paddle base + warmfleet[engine-gpu,fetch,tracing] and the prebuilt decode-attention kernel ----
FROM ${ENGINE_BASE} AS engine
ARG ENGINE_EXTRA=engine-gpu
ENV PYTHONDONTWRITEBYTECODE=1 PIP_NO_CACHE_DIR=1 WARMFLEET_LOG_FORMAT=json
# The kernel is built at image build time so that pods (read-only root filesystem) load it as is; without a
# C compiler the engine would decode with Paddle ops (slower, logged). libgomp1: the OpenMP runtime of
# oneDNN (inside the Paddle wheel), which runs the CPU projections.
ENV WARMFLEET_KERNEL_DIR=/opt/warmfleet/kernels
RUN (command -v cc >/dev/null && ldconfig -p | grep -q libgomp.so.1) \
    || (apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev libgomp1 \
        && rm -rf /var/lib/apt/lists/*)
COPY scripts/image-steps.sh /usr/local/bin/warmfleet-image-steps
# The base image already ships paddlepaddle-gpu; engine-gpu installs everything else the engine needs, and
# fetch lets this image run the `warmfleet fetch-model` step too.
RUN --mount=type=bind,from=wheel,source=/dist,target=/dist \
    PYTHON=python ENGINE_EXTRA=${ENGINE_EXTRA} warmfleet-image-steps engine /dist
RUN useradd --uid 10001 --create-home --shell /usr/sbin/nologin warmfleet
USER 10001:10001
EXPOSE 8000 5557
ENTRYPOINT ["warmfleet"]
CMD ["serve", "--help"]
