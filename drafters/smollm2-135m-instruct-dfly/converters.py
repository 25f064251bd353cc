"""Explicit converters for foreign drafter checkpoints, chosen by what their `config.json` declares.

* z-lab DFlash (`architectures: ["DFlashDraftModel"]` with a nested `dflash_config`): same weight names as ours.
* Tencent AngelSpec DFly (`architectures: ["Qwen3DFlyModel"]` or `["DFlyDraftModel"]`, with `target_num_hidden_layers`):
  `context_proj/context_norm/final_norm/hidden_correction` become `fc/hidden_norm/norm/ar_head`; its frozen copy of
  the target's embedding is dropped (we use the target's own).

A checkpoint that declares neither is native and goes through `PreTrainedModel.from_pretrained`.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from .configuration_drafter import evenly_spaced_layer_ids
from .configuration_dflash import DFlashConfig
from .modeling_dflash import DFlashDrafter
from .configuration_dfly import DFlyConfig
from .modeling_dfly import DFlyDrafter
from .drafter_utils import read_config_dict

logger = logging.getLogger(__name__)

_HUB_KWARGS = ("cache_dir", "force_download", "local_files_only", "token", "revision", "subfolder")
# `from_pretrained` arguments that are not config fields (the attention backend is applied after loading).
_LOADER_KWARGS = _HUB_KWARGS + (
    "dtype", "torch_dtype", "attn_implementation", "trust_remote_code", "device_map", "low_cpu_mem_usage", "_from_auto",
)
_QWEN3_FIELDS = (
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "rms_norm_eps", "max_position_embeddings", "hidden_act", "attention_bias",
    "bos_token_id", "eos_token_id", "pad_token_id",
)


def _backbone_fields(cfg: dict) -> dict:
    fields = {k: cfg[k] for k in _QWEN3_FIELDS if k in cfg}
    layer_types = cfg.get("layer_types") or ["full_attention"] * cfg["num_hidden_layers"]
    if any(t != "full_attention" for t in layer_types):
        raise ValueError(f"only full-attention drafter layers are supported, this checkpoint has {layer_types}")
    fields["rope_parameters"] = cfg.get("rope_parameters") or {
        "rope_type": "default", "rope_theta": float(cfg.get("rope_theta", 10000.0)),
    }
    return fields


def _zlab_dflash_config(cfg: dict, overrides: dict) -> DFlashConfig:
    dflash = cfg["dflash_config"]
    block_size = dflash.get("block_size", cfg.get("block_size"))
    if block_size is None:
        raise ValueError("z-lab DFlash config.json has no block_size (top level or in dflash_config)")
    num_target_layers = cfg.get("num_target_layers")
    layer_ids = dflash.get("target_layer_ids")
    if layer_ids is None:
        if num_target_layers is None:
            raise ValueError("z-lab DFlash config.json gives neither dflash_config.target_layer_ids nor num_target_layers")
        layer_ids = evenly_spaced_layer_ids(num_target_layers, cfg["num_hidden_layers"])
    fields = _backbone_fields(cfg) | {
        "block_size": block_size, "mask_token_id": dflash["mask_token_id"], "target_layer_ids": list(layer_ids),
        "num_target_layers": num_target_layers,
    }
    return DFlashConfig(**(fields | overrides))


def _angelspec_dfly_config(cfg: dict, overrides: dict) -> DFlyConfig:
    if cfg.get("target_hidden_size", cfg["hidden_size"]) != cfg["hidden_size"]:
        raise ValueError(
            f"AngelSpec DFly checkpoint has target_hidden_size {cfg['target_hidden_size']} != hidden_size "
            f"{cfg['hidden_size']}; only drafters as wide as their target are supported"
        )
    if cfg.get("draft_vocab_size", cfg["vocab_size"]) != cfg["vocab_size"]:
        raise ValueError(
            f"AngelSpec DFly checkpoint has a pruned draft vocabulary ({cfg['draft_vocab_size']} of "
            f"{cfg['vocab_size']}); vocabulary-pruned drafters are not supported"
        )
    fields = _backbone_fields(cfg) | {
        # AngelSpec's `num_target_layers` counts the captured layers; the target's depth is `target_num_hidden_layers`.
        "num_target_layers": cfg.get("target_num_hidden_layers"),
        "target_layer_ids": list(cfg["target_layer_ids"]),
        "mask_token_id": cfg["mask_token_id"],
        "block_size": cfg.get("block_size", 8),
        "use_ar_head": bool(cfg.get("enable_hidden_correction", True)),
        "ar_head_intermediate_size": cfg.get("hidden_correction_intermediate_size") or cfg["hidden_size"],
    }
    return DFlyConfig(**(fields | overrides))


def _angelspec_dfly_weights(state: dict) -> dict:
    renames = {"context_proj.": "fc.", "context_norm.": "hidden_norm.", "final_norm.": "norm.",
               "hidden_correction.": "ar_head."}
    out = {}
    for name, tensor in state.items():
        if name in ("embed_tokens.weight", "lm_head.weight"):
            logger.info("dropping %s from the AngelSpec checkpoint: the target's own is used", name)
            continue
        if name in ("t2d", "d2t"):
            raise ValueError("vocabulary-pruned AngelSpec checkpoints (t2d/d2t) are not supported")
        for old, new in renames.items():
            if name.startswith(old):
                name = new + name[len(old):]
                break
        out[name] = tensor
    return out


# (name, test on config.json, drafter class, config builder, weight renamer)
FOREIGN_FORMATS = (
    ("z-lab DFlash", lambda c: "DFlashDraftModel" in (c.get("architectures") or []) and "dflash_config" in c,
     DFlashDrafter, _zlab_dflash_config, lambda s: s),
    ("AngelSpec DFly", lambda c: bool({"Qwen3DFlyModel", "DFlyDraftModel"} & set(c.get("architectures") or []))
     and "target_num_hidden_layers" in c, DFlyDrafter, _angelspec_dfly_config, _angelspec_dfly_weights),
)


def _load_safetensors(path_or_repo, hub_kwargs) -> dict:
    from transformers.utils import cached_file

    index = cached_file(path_or_repo, "model.safetensors.index.json", _raise_exceptions_for_missing_entries=False,
                        **hub_kwargs)
    if index is None:
        return load_file(cached_file(path_or_repo, "model.safetensors", **hub_kwargs))
    state = {}
    for shard in sorted(set(json.loads(Path(index).read_text())["weight_map"].values())):
        state.update(load_file(cached_file(path_or_repo, shard, **hub_kwargs)))
    return state


def load_foreign_checkpoint(cls, path_or_repo, **kwargs):
    """The converted drafter if `path_or_repo` holds a foreign format, else None. `cls` (optional) must fit it."""
    hub_kwargs = {k: kwargs[k] for k in _HUB_KWARGS if k in kwargs}
    cfg = read_config_dict(str(path_or_repo), **hub_kwargs)
    for name, matches, drafter_cls, build_config, rename in FOREIGN_FORMATS:
        if not matches(cfg):
            continue
        if cls is not None and not issubclass(drafter_cls, cls):
            raise ValueError(f"{path_or_repo} is a {name} checkpoint; load it with {drafter_cls.__name__}, not {cls.__name__}")
        # As with `from_pretrained(path, attr=value)`, other keyword arguments override config fields
        # (e.g. `block_size=8` for an AngelSpec checkpoint, whose config.json does not record it).
        overrides = {k: v for k, v in kwargs.items() if k not in _LOADER_KWARGS}
        config = build_config(cfg, overrides)
        state = rename(_load_safetensors(str(path_or_repo), hub_kwargs))
        dtype = kwargs.get("dtype", kwargs.get("torch_dtype", "auto"))
        if dtype == "auto":
            dtype = next(iter(state.values())).dtype if state else torch.float32
        model = drafter_cls(config)
        missing, unexpected = model.load_state_dict(state, strict=False)
        if missing or unexpected:
            raise ValueError(f"{name} checkpoint {path_or_repo}: missing weights {missing}, unexpected weights {unexpected}")
        if kwargs.get("attn_implementation"):
            model.set_attn_implementation(kwargs["attn_implementation"])
        return model.to(dtype).eval()
    return None


def export_zlab_dflash(drafter: DFlashDrafter, folder) -> Path:
    """Write a DFlash drafter in z-lab's Hub layout (the format vLLM and SGLang serve): `config.json` with
    `architectures: ["DFlashDraftModel"]`, `model_type: qwen3`, top-level `block_size` and a nested `dflash_config`,
    plus `model.safetensors` under the same weight names. It loads back through `load_foreign_checkpoint`."""
    if type(drafter) is not DFlashDrafter:
        raise ValueError(f"only DFlashDrafter has a z-lab layout, not {type(drafter).__name__}")
    if drafter.config.draft_vocab_size is not None:
        raise ValueError(
            f"z-lab's DFlash layout has no draft vocabulary map: this drafter drafts over {drafter.config.draft_vocab_size} "
            f"of {drafter.config.vocab_size} tokens. Export a copy over the whole vocabulary (drafter.set_draft_vocab(None)).")
    c = drafter.config
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    config = {k: getattr(c, k) for k in _QWEN3_FIELDS}
    config |= {
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "block_size": c.block_size,
        "num_target_layers": c.num_target_layers,
        "dflash_config": {"mask_token_id": c.mask_token_id, "target_layer_ids": list(c.target_layer_ids)},
        "rope_theta": c.rope_parameters["rope_theta"], "layer_types": list(c.layer_types),
        "tie_word_embeddings": False, "use_sliding_window": False, "sliding_window": None,
        "dtype": str(drafter.dtype).removeprefix("torch."),
    }
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_file({k: v.detach().contiguous() for k, v in drafter.state_dict().items()}, folder / "model.safetensors",
              metadata={"format": "pt"})
    return folder
