#!/usr/bin/env bash
# A venv with the GPU machine's Python and package versions, for rehearsing the playbook on the CPU under them:
#   PY312=python3.12 bash scripts/gpu/image_twin.sh /tmp/image-twin
#   ... then PLAYBOOK_PYTHON=/tmp/image-twin/bin/python in docs/gpu.md's rehearsal
# The versions are those the device library's KINDS.md lists for the machine's image ("pip list, as a session saw
# it"): Python 3.12, torch 2.11.0 (its CUDA 13 build from the registry: ~3 GB of downloads, which runs on the CPU
# here), triton 3.6.0, numpy 2.5.2, accelerate 1.15.0, huggingface_hub 1.33.0, safetensors 0.8.0, tokenizers
# 0.23.2, plus the image's unversioned packages that the code or the tests import. What the image lacks
# (transformers 5.24, gguf, datasets, dill, multiprocess) is not installed: the playbook's `unpack` installs it from
# the payload's wheels into its site dir, as on the machine.
set -euo pipefail
dest=${1:?usage: image_twin.sh <venv folder>}
PY312=${PY312:-python3.12}
"$PY312" -c 'import sys; assert sys.version_info[:2] == (3, 12), sys.version' \
  || { echo "image_twin.sh: PY312 must be a Python 3.12 (the machine's), not $PY312"; exit 2; }
"$PY312" -m venv "$dest"
"$dest/bin/pip" install -q --upgrade pip
"$dest/bin/pip" install -q torch==2.11.0 triton==3.6.0 numpy==2.5.2 accelerate==1.15.0 huggingface_hub==1.33.0 \
  safetensors==0.8.0 tokenizers==0.23.2
"$dest/bin/pip" install -q peft pyarrow pytest pytest-xdist pytest-timeout hypothesis scipy matplotlib tensorboard \
  pandas xxhash regex requests jinja2 psutil
"$dest/bin/python" -c 'import torch, triton, numpy; print("image twin:", torch.__version__, "triton", triton.__version__,
      "numpy", numpy.__version__)'
