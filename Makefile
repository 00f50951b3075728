# herd: two commands do everything on a fresh machine — `make demo` and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test lint pytest soak bench clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[test]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/herd demo

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/lint-imports
	$(BIN)/mypy infra manifests p2p scheduler_link agent placer cli testing bench

# the suite in PYTEST_WORKERS processes (pytest-xdist; 1: serially, in this process)
PYTEST_WORKERS ?= 2
pytest: $(STAMP)
	$(BIN)/python -m pytest -q $(if $(filter 1,$(PYTEST_WORKERS)),,-n $(PYTEST_WORKERS))

test: lint pytest

# ~10 minutes of jobs with faults (HERD_SOAK_SEED, HERD_SOAK_SECONDS); make test runs a 30 s version
soak: $(STAMP)
	$(BIN)/python -m pytest -q -s -m soak tests/test_soak.py

bench: $(STAMP)
	$(BIN)/python -m bench.artifacts
	$(BIN)/python -m bench.node
	$(BIN)/python -m bench.publish
	$(BIN)/python -m bench.gpus
	$(BIN)/python -m bench.agent
	$(BIN)/python -m bench.placer
	$(BIN)/python -m bench.link
	$(BIN)/python -m bench.origin_read
	$(BIN)/python -m bench.tls_handshake
	$(BIN)/python -m bench.msgauth
	$(BIN)/python -m bench.relay_round
	$(BIN)/python -m bench.fleet --nodes 4096
	$(BIN)/python -m bench.delivery --nodes 4096
	$(BIN)/python -m bench.herd
	$(BIN)/python -m bench.herd_sim

# every bench once at small sizes (< 5 min), checking that docs/performance.md names only
# JSON keys the benches print; not part of make test
.PHONY: bench-quick
bench-quick: $(STAMP)
	$(BIN)/python -m bench.quick

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .mypy_cache .ruff_cache
