# Developer entry points. `make demo` and `make test` are the README's two commands.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: demo test test-fast e2e bench lint clean

$(BIN)/warmfleet: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[all]'
	@touch $@

## demo: set up, then run a local fleet (replicas + router) on a tiny checkpoint made on first run
demo: $(BIN)/warmfleet
	$(BIN)/warmfleet demo

## test: set up, then run every unit and integration test
test: $(BIN)/warmfleet
	$(BIN)/pytest -q

## e2e: the chart and operator against a local kwok cluster (builds Kubernetes from Go modules once)
e2e: $(BIN)/warmfleet
	./.ci/e2e.sh

## bench: the prefix-cache benchmark, quick mode
bench: $(BIN)/warmfleet
	$(BIN)/python bench/prefix_cache.py --quick --json

clean:
	rm -rf $(VENV) .pytest_cache
