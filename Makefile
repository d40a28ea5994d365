# Set-up is idempotent: the venv is rebuilt only when pyproject.toml changes.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.kvcanary-installed
# CPU torch unless an NVIDIA GPU is visible; the package itself only asks for torch>=2.4.
HAS_GPU := $(shell command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && echo 1)
TORCH_SPEC ?= $(if $(HAS_GPU),torch>=2.4,torch==2.13.0)
PYTEST_WORKERS ?= 2

.PHONY: setup test demo lint clean

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[dev]"
	touch $(STAMP)

test: $(STAMP)
	$(VENV)/bin/ruff check src tests
	$(VENV)/bin/mypy
	$(PY) -m pytest -q -n $(PYTEST_WORKERS) tests

# The main job: the hybrid sliding-window preset with the canary on, prompts sharing a prefix
# and far longer than the 32-token window, an SWA pool 1/8 of the full pool (window eviction,
# SWA tombstoning in the prefix cache and retraction all happen).
demo: $(STAMP)
	$(VENV)/bin/kvcanary run --model builtin:tiny-swa --kv-canary log --kv-canary-real-data partial \
		--num-requests 64 --input-len 256 --shared-prefix-len 128 --output-len 96 \
		--page-size 4 --swa-full-tokens-ratio 0.125 --json demo.json

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests
	$(VENV)/bin/mypy

clean:
	rm -rf $(VENV)
