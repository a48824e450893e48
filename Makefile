# dsakv — two commands: `make run` and `make test`.
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
# GPU users: make install TORCH_SPEC="torch==2.13.0" TORCH_INDEX="--index-url https://download.pytorch.org/whl/cu128"
TORCH_INDEX ?=
BIN := $(VENV)/bin
STAMP := $(VENV)/.dsakv-installed

.PHONY: install system-libs run test lint bench clean

install: system-libs $(STAMP)

# Every time (cheap): a machine that lost a system library gets it back.
system-libs:
	@bash scripts/check_system_libs.sh

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q $(TORCH_INDEX) "$(TORCH_SPEC)"
	$(BIN)/python -m pip install -q -e '.[dev]'
	touch $(STAMP)

run: install
	$(BIN)/dsakv bench

test: install
	$(BIN)/python -m pytest

lint: install
	$(BIN)/ruff check src tests

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache
