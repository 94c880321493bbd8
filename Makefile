# Two commands for a fresh machine: `make demo` and `make test`.
# Torch is pinned here only (the library asks for torch>=2.4); GPU users override it:
#   make test TORCH="torch==2.13.0 --index-url https://download.pytorch.org/whl/cu126"
PYTHON ?= python3
TORCH ?= torch==2.13.0
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.rlft-installed

.PHONY: install test test-slow demo bench clean

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q $(TORCH)
	$(BIN)/python -m pip install -q -e ".[dev]"
	touch $(STAMP)

install: $(STAMP)

test: $(STAMP)
	$(BIN)/python -m pytest -q

test-slow: $(STAMP)
	$(BIN)/python -m pytest -q -m slow

demo: $(STAMP)
	$(BIN)/rlft demo

clean:
	rm -rf $(VENV) demo-output runs
