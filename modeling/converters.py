"""Explicit converters for foreign drafter checkpoints, chosen by what their `config.json` declares.

* z-lab DFlash (`architectures: ["DFlashDraftModel"]` with a nested `dflash_config`): same weight names as ours.
* Tencent AngelSpec DFly (`architectures: ["Qwen3DFlyModel"]` or `["DFlyDraftModel"]`, with `target_num_hidden_layers`):
  `context_proj/context_norm/final_norm/hidden_correction` become `fc/hidden_norm/norm/ar_head`; its frozen copy of
  the target's embedding is dropped (we use the target's own).
* EAGLE-3 as vLLM and SGLang load it (`architectures: ["LlamaForCausalLMEagle3"]`), written by `export_eagle` from an
  MTP drafter with `layout="eagle3"` (marked by a nested `angelspec` block): `midlayer.` becomes `layers.0.`, `d2t`
  becomes `draft_vocab_ids`, and `lm_head.weight` (the target's own rows) is dropped. Other EAGLE-3 checkpoints train
  their own LM head, which AngelSpec drafters do not have: they are refused.

A checkpoint that declares neither is native and goes through `PreTrainedModel.from_pretrained`.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from .dflash.configuration_dflash import DFlashConfig, evenly_spaced_layer_ids
from .dflash.modeling_dflash import DFlashDrafter
from .dfly.configuration_dfly import DFlyConfig
from .dfly.modeling_dfly import DFlyDrafter
from .drafter_library import read_config_dict
from .mtp.configuration_mtp import MTPConfig, engines_eagle3_layer_ids
from .mtp.modeling_mtp import MTPDrafter

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


# ---- EAGLE-3 (vLLM `models/llama_eagle3.py` `Eagle3LlamaForCausalLM`, SGLang `models/llama_eagle3.py`
# `LlamaForCausalLMEagle3`) -------------------------------------------------------------------------------------------
EAGLE3_ARCHITECTURES = {"LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM"}  # both engines map either name
# An MTP drafter's fields with no EAGLE-3 counterpart, kept in the export's nested `angelspec` block.
_MTP_FIELDS = ("layout", "target_layer_ids", "num_target_layers", "target_model_type", "num_draft_tokens",
               "draft_length", "draft_stop_threshold", "lookup_tokens", "lookup_max_ngram")


def _is_angelspec_eagle3(cfg: dict) -> bool:
    return bool(EAGLE3_ARCHITECTURES & set(cfg.get("architectures") or [])) and (
        (cfg.get("angelspec") or {}).get("layout") == "eagle3")


def _angelspec_eagle3_config(cfg: dict, overrides: dict) -> MTPConfig:
    fields = _backbone_fields(cfg) | dict(cfg["angelspec"])
    if cfg.get("rope_scaling"):  # engines read the legacy keys; ours are `rope_parameters`
        fields["rope_parameters"] = dict(cfg["rope_scaling"]) | {"rope_theta": float(cfg.get("rope_theta", 10000.0))}
    draft_vocab = cfg.get("draft_vocab_size") or cfg["vocab_size"]
    fields["draft_vocab_size"] = draft_vocab if draft_vocab < cfg["vocab_size"] else None
    return MTPConfig(**(fields | overrides))


def _angelspec_eagle3_weights(state: dict) -> dict:
    out, d2t = {}, None
    for name, tensor in state.items():
        if name in ("lm_head.weight", "t2d"):  # the target's own head rows; the mask t2d repeats d2t
            continue
        if name == "d2t":  # EAGLE-3 stores offsets: draft id i is target id i + d2t[i]
            d2t = tensor
            continue
        out[name.replace("midlayer.", "layers.0.", 1) if name.startswith("midlayer.") else name] = tensor
    if d2t is not None:
        out["draft_vocab_ids"] = torch.arange(len(d2t)) + d2t.long()
    return out


def _refuse_other_eagle3(cfg: dict, overrides: dict):
    raise ValueError(
        "this is an EAGLE-3 checkpoint with its own trained LM head; AngelSpec drafters draft through the target's "
        "LM head, so it cannot be loaded as one. Serve it with vLLM or SGLang, or train an MTP drafter with "
        "layout='eagle3' (`angelspec train --drafter mtp --config_overrides layout=eagle3`).")


# (name, test on config.json, drafter class, config builder, weight renamer)
FOREIGN_FORMATS = (
    ("z-lab DFlash", lambda c: "DFlashDraftModel" in (c.get("architectures") or []) and "dflash_config" in c,
     DFlashDrafter, _zlab_dflash_config, lambda s: s),
    ("AngelSpec DFly", lambda c: bool({"Qwen3DFlyModel", "DFlyDraftModel"} & set(c.get("architectures") or []))
     and "target_num_hidden_layers" in c, DFlyDrafter, _angelspec_dfly_config, _angelspec_dfly_weights),
    ("AngelSpec MTP in the EAGLE-3 layout", _is_angelspec_eagle3, MTPDrafter, _angelspec_eagle3_config,
     _angelspec_eagle3_weights),
    ("EAGLE-3", lambda c: bool(EAGLE3_ARCHITECTURES & set(c.get("architectures") or [])), MTPDrafter,
     _refuse_other_eagle3, None),
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
            dtype = next((t.dtype for t in state.values() if t.is_floating_point()), torch.float32)
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


def check_eagle_exportable(drafter) -> None:
    """Raise a `ValueError` saying what to do instead when `export_eagle` cannot express `drafter` exactly."""
    if not isinstance(drafter, MTPDrafter):
        hint = ("export it to z-lab's DFlash layout with `export_zlab_dflash` (`angelspec export --format zlab`), which "
                "vLLM and SGLang serve as `dflash`" if type(drafter) is DFlashDrafter else
                "neither vLLM nor SGLang has its architecture (block drafting with an autoregressive head and "
                "per-layer target fusion); serve it with `angelspec serve`")
        raise ValueError(f"only an MTP drafter with layout='eagle3' has an EAGLE layout, not {type(drafter).__name__}: "
                         f"{hint}")
    if drafter.config.layout != "eagle3":
        raise ValueError(
            f"this MTP drafter has layout={drafter.config.layout!r}: its eh_proj/hnorm/enorm input and Qwen3 layer "
            "(QK-norm, normed fused input) cannot be expressed in vLLM's or SGLang's EAGLE layouts (EAGLE-3 norms the "
            "embedding and the state inside the layer, keeps the un-normed state as residual and has no QK-norm; "
            "EAGLE-1 has no final norm). Train a drafter in the EAGLE-3 layout and export that one: "
            "`angelspec train --drafter mtp --config_overrides layout=eagle3 ...`.")


def export_eagle(drafter: MTPDrafter, folder, target) -> Path:
    """Write an MTP drafter with `layout="eagle3"` in the EAGLE-3 layout vLLM (`--speculative-config
    '{"method": "eagle3", ...}'`) and SGLang (`--speculative-algorithm EAGLE3`) load: `config.json` (a Llama config,
    `architectures: ["LlamaForCausalLMEagle3"]`, `draft_vocab_size`, `target_hidden_size`) and `model.safetensors` with
    `fc.weight` `[H, 3H]`, `midlayer.*` (the one decoder layer, q/k/v `[*, 2H]`), `norm.weight`, `lm_head.weight`
    (the `target`'s LM head rows for the draft vocabulary, `[draft_vocab_size, H]`) and, for a pruned draft vocabulary,
    `d2t` (offsets: draft id i drafts target id `i + d2t[i]`) and `t2d` (a `[vocab_size]` bool mask). The embedding is
    not written: both engines share the target's. It loads back through `load_foreign_checkpoint`."""
    check_eagle_exportable(drafter)
    c = drafter.config
    drafter.check_target(target)
    head = target.get_output_embeddings().weight.detach()  # [V, H]
    pruned = c.draft_vocab_size is not None
    ids = drafter.draft_vocab_ids.to(head.device) if pruned else torch.arange(c.vocab_size, device=head.device)
    dtype = drafter.dtype
    state = {"fc.weight": drafter.fc.weight, "norm.weight": drafter.norm.weight}
    state |= {f"midlayer.{name}": t for name, t in drafter.layers[0].state_dict().items()}
    state["lm_head.weight"] = head[ids].to(dtype)
    if pruned:
        ids = ids.cpu()
        state["d2t"] = ids - torch.arange(len(ids))
        state["t2d"] = torch.zeros(c.vocab_size, dtype=torch.bool).index_fill_(0, ids, True)
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    layer_ids = list(c.target_layer_ids)
    config = {k: getattr(c, k) for k in _QWEN3_FIELDS} | {
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "num_hidden_layers": 1,
        "draft_vocab_size": len(ids), "target_hidden_size": c.hidden_size, "tie_word_embeddings": False,
        "mlp_bias": False, "rope_theta": c.rope_parameters["rope_theta"], "torch_dtype": str(dtype).removeprefix("torch."),
        "rope_scaling": None if c.rope_parameters.get("rope_type", "default") == "default" else
        {k: v for k, v in c.rope_parameters.items() if k != "rope_theta"},
        "eagle_config": {"use_aux_hidden_state": True},
        "angelspec": {k: getattr(c, k) for k in _MTP_FIELDS},
    }
    if c.num_target_layers is None or layer_ids != engines_eagle3_layer_ids(c.num_target_layers):
        # Not the engines' default layers, so name them, in each engine's own convention: vLLM reads the top-level
        # key as the layers whose *input* it captures (gpu_model_runner, llama.py); SGLang reads `eagle_config`'s as
        # layer outputs and adds 1 itself (model_runner, llama.py `set_eagle3_layers_to_capture`).
        config["eagle_aux_hidden_state_layer_ids"] = [i + 1 for i in layer_ids]
        config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = layer_ids
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_file({k: v.detach().contiguous() for k, v in state.items()}, folder / "model.safetensors",
              metadata={"format": "pt"})
    return folder
