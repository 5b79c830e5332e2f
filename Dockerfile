# warmfleet server/router/operator image on a PaddlePaddle GPU base.
#
# PyPI's `paddlepaddle-gpu` stops at 2.6, so the GPU runtime comes from Paddle's own image (or
# wheel index: https://www.paddlepaddle.org.cn/packages/stable/cu126/). Build:
#   docker build -t ghcr.io/warmfleet/warmfleet:0.1.0 .
# CPU-only image (tests, demos): --build-arg BASE_IMAGE=python:3.11-slim --build-arg ENGINE_EXTRA=engine
ARG BASE_IMAGE=paddlepaddle/paddle:3.0.0-gpu-cuda12.6-cudnn9.5-trt10.5
FROM ${BASE_IMAGE}

ARG ENGINE_EXTRA=engine-gpu
ENV PYTHONDONTWRITEBYTECODE=1 PIP_NO_CACHE_DIR=1 WARMFLEET_LOG_FORMAT=json

WORKDIR /opt/warmfleet
COPY pyproject.toml README.md ./
COPY warmfleet ./warmfleet
COPY server ./server
COPY operator ./operator
# The base image already ships paddlepaddle-gpu; `engine-gpu` installs everything else the engine needs;
# `fetch` lets this image run the `warmfleet fetch-model` init container (also in vLLM and FastDeploy pods).
RUN python -m pip install --no-deps . \
 && python -m pip install ".[${ENGINE_EXTRA},operator,fetch]" \
 && python -c "import paddle, warmfleet.server.config; print('paddle', paddle.__version__)"

# The CPU backend's decode-attention kernel, built here so that pods (read-only root filesystem) load it
# as is; without a C compiler in the image the engine would decode with Paddle ops (slower, logged).
ENV WARMFLEET_KERNEL_DIR=/opt/warmfleet/kernels
# libgomp1: the OpenMP runtime of oneDNN (inside the Paddle wheel), which runs the CPU projections.
RUN (command -v cc >/dev/null && ldconfig -p | grep -q libgomp.so.1 \
     || (apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev libgomp1)) \
 && python -c "from warmfleet.server.attention import native; print('kernel', native.build())"

# Non-root by default; the operator's pod spec also sets runAsNonRoot and a read-only root filesystem.
RUN useradd --uid 10001 --create-home --shell /usr/sbin/nologin warmfleet
USER 10001:10001
EXPOSE 8000 5557
ENTRYPOINT ["warmfleet"]
CMD ["serve", "--help"]
