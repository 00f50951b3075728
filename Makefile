# herd: two commands do everything on a fresh machine — `make demo` and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test lint pytest bench clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[test]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/herd demo

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/mypy manifests p2p scheduler_link agent placer cli

pytest: $(STAMP)
	$(BIN)/python -m pytest -q

test: lint pytest

bench: $(STAMP)
	$(BIN)/python -m bench.artifacts
	$(BIN)/python -m bench.gpus
	$(BIN)/python -m bench.agent
	$(BIN)/python -m bench.placer
	$(BIN)/python -m bench.link
	$(BIN)/python -m bench.herd
	$(BIN)/python -m bench.herd_sim

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .mypy_cache .ruff_cache
