# dsakv — two commands: `make run` and `make test`.
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
# GPU users: make install TORCH_SPEC="torch==2.13.0" TORCH_INDEX="--index-url https://download.pytorch.org/whl/cu128"
TORCH_INDEX ?=
BIN := $(VENV)/bin
STAMP := $(VENV)/.dsakv-installed
# The H200 image's Triton beside the venv's, for `dsakv device-check --compile-only
# --triton-path .triton-3.6` (make test runs both): compiling needs only its wheel, no deps.
TRITON_36 ?= .triton-3.6
TRITON_36_STAMP := $(TRITON_36)/.installed

.PHONY: install system-libs run test lint clean wheelhouse device-check-dry device-models

install: system-libs $(STAMP) $(TRITON_36_STAMP)

# Every time (cheap): a machine that lost a system library gets it back.
system-libs:
	@bash scripts/check_system_libs.sh

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q $(TORCH_INDEX) "$(TORCH_SPEC)"
	$(BIN)/python -m pip install -q -e '.[dev]'
	touch $(STAMP)

$(TRITON_36_STAMP): | $(STAMP)
	rm -rf $(TRITON_36)
	$(BIN)/python -m pip install -q --no-deps --only-binary=:all: --target $(TRITON_36) "triton==3.6.0"
	touch $@

run: install
	$(BIN)/dsakv bench --json bench-out/bench.json --plot bench-out/plots

# Test files run on TEST_WORKERS processes (pytest-xdist), each file's tests on one of them,
# so a file's module fixtures (servers, PD pairs) start once. Most tests run one torch
# thread: two workers keep both cores of a small machine busy. TEST_WORKERS=0: one process.
TEST_WORKERS ?= 2
test: install
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadfile

# Wheels the GPU machine's image lacks (it has torch + triton, no network): its python3 is
# 3.12 and its transformers (5.17) older than the `indexed_attention` layer type dsakv's
# configs use, which even its tokenizer loading validates. 5.24 is the newest that still
# takes the image's huggingface_hub 1.x (5.25 needs hub 2.x and its new HTTP stack).
# xgrammar, FastAPI and uvicorn, with what they need that the image lacks, come at the
# venv's versions (~8 MiB).
# scripts/device_check.sh unpacks whatever lies in .whl/ (no pip needed there).
WHEEL_PY ?= 3.12
WHEEL_TRANSFORMERS ?= 5.24.0
WHEELS_AS_VENV := xgrammar apache-tvm-ffi pydantic pydantic-core annotated-types typing-inspection \
	fastapi starlette uvicorn opentelemetry-api
wheelhouse: install
	rm -rf .whl && mkdir -p .whl
	$(BIN)/python -m pip download -q --no-deps --only-binary=:all: --python-version $(WHEEL_PY) \
		--implementation cp --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 \
		-d .whl "transformers==$(WHEEL_TRANSFORMERS)" $$($(BIN)/python -c \
		'import importlib.metadata as m, sys; print(*(f"{n}=={m.version(n)}" for n in sys.argv[1:]))' \
		$(WHEELS_AS_VENV))
	du -sh .whl

device-check-dry: install
	scripts/device_check.sh --dry-run --out /tmp/dsakv-device-check

# The device check's model, generated here on the CPU for the GPU run to carry
# (`carry: [".device-models"]`, ~24 MiB, git-ignored); the check reads it from there.
device-models: install
	$(BIN)/python -m dsakv.cli device-check --prepare .device-models
	du -sh .device-models

lint: install
	$(BIN)/ruff check src tests

clean:
	rm -rf $(VENV) $(TRITON_36) build src/*.egg-info .pytest_cache
