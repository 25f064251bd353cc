"""What the angelspec-hf library adds to every drafter beyond the code of its Hub folder: target checks, the generate()
hook's draft-length policy, the oneDNN-prepacked pruned head, building from a target (configs, draft vocabulary, deeper
copies) and the code export `save_pretrained` writes. `DrafterPreTrainedModel`'s *library* methods call these; none of
this file is copied into a Hub folder (`export_code` follows relative imports, and the folder's code reaches this file
only through `drafter_utils.library`)."""

from __future__ import annotations

import copy
import importlib
import importlib.util
import json
import os
import re
from pathlib import Path

import torch
from torch import nn

from angelspec_hf.policy import hardware_key, load_or_profile_round_costs

from .draft_policy import DraftLengthPolicy
from .drafter_utils import PrunedLMHead


class PackedPrunedLMHead(PrunedLMHead):
    """`PrunedLMHead` of a target head that reads oneDNN-prepacked weights (`angelspec_hf.prepack_linears`): the
    gathered rows are prepacked too (drafting runs the head once per position)."""

    def __init__(self, lm_head: nn.Module, ids: torch.LongTensor):
        super().__init__(lm_head, ids)
        self.pack = self.weight.device.type == "cpu" and self.weight.dtype == torch.float32
        self.packed = None  # made at first use

    def __getstate__(self):  # the packed copy is an opaque oneDNN tensor: copies and pickles pack again when used
        return {**super().__getstate__(), "packed": None}

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if not (self.pack and hidden.dtype == torch.float32 and hidden.device.type == "cpu" and hidden.numel()
                and not (torch.is_grad_enabled() and hidden.requires_grad)):
            return super().forward(hidden)
        if self.packed is None:
            self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight, None)
        return self.scatter(torch.ops.mkldnn._linear_pointwise(hidden.contiguous(), self.packed, self.bias, "none",
                                                               [], ""))


HUB_KWARGS = ("cache_dir", "force_download", "proxies", "token", "revision", "local_files_only", "subfolder")


def attach_lookup_corpus(drafter, name_or_path, **kwargs) -> None:
    """Give `drafter` the lookup corpus its folder or Hub repository holds (`lookup_corpus.safetensors`, a
    `angelspec_hf.policy.CorpusIndex`) as `drafter.lookup_corpus`, resolved as `from_pretrained` resolved the
    weights (`kwargs`: its hub arguments; the weights' commit unless a revision is given); None where there is none.
    A corpus that cannot be read is a warning, not an error: the drafter works without it. Its suffix array is built
    on the first lookup."""
    import warnings

    from transformers.utils import cached_file

    from angelspec_hf.policy.corpus import LOOKUP_CORPUS_FILE, CorpusIndex

    hub = {k: kwargs[k] for k in HUB_KWARGS if k in kwargs}
    commit = getattr(drafter.config, "_commit_hash", None)
    if commit and not hub.get("revision"):  # the corpus of the commit the weights came from
        hub["revision"] = commit
    drafter.lookup_corpus = None
    try:
        path = cached_file(str(name_or_path), LOOKUP_CORPUS_FILE, _raise_exceptions_for_missing_entries=False,
                           _raise_exceptions_for_connection_errors=False, **hub)
        if path is not None:
            drafter.lookup_corpus = CorpusIndex.load(path)
    except Exception as error:  # noqa: BLE001 - optional: the drafter is whole without it
        warnings.warn(f"{name_or_path}: its {LOOKUP_CORPUS_FILE} could not be read ({type(error).__name__}: "
                      f"{error}); the drafter loads without corpus lookups", stacklevel=2)


def check_target(drafter, target) -> None:
    """Raise a `ValueError` naming both values when `drafter` cannot read/serve `target` (a model or its config)."""
    tc = (target.config if hasattr(target, "config") else target).get_text_config()
    c = drafter.config
    if tc.vocab_size != c.vocab_size:
        raise ValueError(f"drafter vocab_size {c.vocab_size} does not match the target's vocab_size {tc.vocab_size}")
    if tc.hidden_size != c.hidden_size:
        raise ValueError(
            f"drafter hidden_size {c.hidden_size} does not match the target's hidden_size {tc.hidden_size} "
            f"(the drafter reads the target's hidden states and shares its embedding and LM head)"
        )
    if max(c.target_layer_ids) >= tc.num_hidden_layers:
        raise ValueError(
            f"drafter target_layer_ids {list(c.target_layer_ids)} reach layer {max(c.target_layer_ids)}, "
            f"but the target has only {tc.num_hidden_layers} layers"
        )
    mask_id = getattr(c, "mask_token_id", None)
    if mask_id is not None and mask_id >= tc.vocab_size:
        raise ValueError(f"drafter mask_token_id {mask_id} is outside the target's vocabulary ({tc.vocab_size})")


def draft_policy(drafter, target, cache_dir=None) -> DraftLengthPolicy:
    """The `generate()` hook's draft-length policy for `drafter` beside `target` on this hardware: round costs
    profiled once and cached (`draft_policy.py`), acceptance learned across calls. Kept on the drafter, one per
    target/hardware (a new target or machine replaces the old one)."""
    key = hardware_key(target, drafter)
    policy = getattr(drafter, "_draft_policies", {}).get(key)
    if policy is None:
        costs = load_or_profile_round_costs(target, drafter, cache_dir)
        policy = DraftLengthPolicy(costs, drafter.num_draft_tokens, device=next(target.parameters()).device)
        drafter._draft_policies = {key: policy}
    return policy


def set_draft_vocab(drafter, ids) -> None:
    """Restrict `drafter`'s drafting to the target token ids `ids` (sorted, deduplicated); `None` restores the whole
    vocabulary. Saved with the weights (`draft_vocab_ids`) and in the config (`draft_vocab_size`)."""
    drafter._draft_heads = {}
    if ids is None:
        drafter.config.draft_vocab_size = None
        drafter._buffers.pop("draft_vocab_ids", None)
        return
    ids = torch.unique(torch.as_tensor(ids, dtype=torch.long))
    if len(ids) == 0 or int(ids.min()) < 0 or int(ids.max()) >= drafter.config.vocab_size:
        raise ValueError(f"draft vocabulary ids must be non-empty and in [0, {drafter.config.vocab_size})")
    drafter.config.draft_vocab_size = len(ids)
    drafter.register_buffer("draft_vocab_ids", ids.to(drafter.device), persistent=True)


def config_from_target(config_class, target_config, **overrides):
    """A `config_class` whose sizes fit `target_config` (a `PreTrainedConfig` or a model); `overrides` win, then the
    family's `target_defaults`."""
    if hasattr(target_config, "config"):
        target_config = target_config.config
    tc = target_config.get_text_config()
    fields = dict(
        vocab_size=tc.vocab_size,
        hidden_size=tc.hidden_size,
        intermediate_size=tc.intermediate_size,
        num_attention_heads=tc.num_attention_heads,
        num_key_value_heads=getattr(tc, "num_key_value_heads", None) or tc.num_attention_heads,
        head_dim=getattr(tc, "head_dim", None) or tc.hidden_size // tc.num_attention_heads,
        hidden_act=getattr(tc, "hidden_act", "silu"),
        rms_norm_eps=getattr(tc, "rms_norm_eps", 1e-6),
        max_position_embeddings=getattr(tc, "max_position_embeddings", 32768),
        rope_parameters=copy.deepcopy(getattr(tc, "rope_parameters", None)),
        num_target_layers=tc.num_hidden_layers,
        target_model_type=tc.model_type,
        bos_token_id=tc.bos_token_id,
        eos_token_id=tc.eos_token_id,
        pad_token_id=tc.pad_token_id,
    )
    fields.update(config_class.target_defaults(tc, overrides))
    fields.update(overrides)
    return config_class(**fields)


@torch.no_grad()
def grow_layers(drafter, num_layers: int) -> None:
    """Deepen a block drafter (DFlash, DFly) to `num_layers` without changing what it computes: new layers of the same
    kind are appended after the last, initialised as usual except their output projections (attention `o_proj`, MLP
    `down_proj`), which start at zero, so each new layer adds nothing to the residual stream until training moves it.
    DFly's per-layer target mixtures (`use_layer_fusion`) get new rows that start even, as a fresh drafter's do."""
    current = len(drafter.layers)
    if num_layers < current:
        raise ValueError(f"cannot shrink a drafter: it has {current} layers, {num_layers} asked")
    if num_layers == current:
        return
    layer_class = type(drafter.layers[-1])
    drafter.config.num_hidden_layers = num_layers
    drafter.config.layer_types = list(drafter.config.layer_types) + ["full_attention"] * (num_layers - current)
    device, dtype = drafter.fc.weight.device, drafter.fc.weight.dtype
    for index in range(current, num_layers):
        layer = layer_class(drafter.config, index)
        layer.apply(drafter._init_weights)
        layer.self_attn.o_proj.weight.zero_()
        layer.mlp.down_proj.weight.zero_()
        drafter.layers.append(layer.to(device=device, dtype=dtype))
    if getattr(drafter.config, "use_layer_fusion", False):
        weights = drafter.layer_fusion_weights
        extra = weights.new_zeros(num_layers - current, weights.shape[1])
        drafter.layer_fusion_weights = nn.Parameter(torch.cat([weights.detach(), extra]))


@torch.no_grad()
def grow_ar_head(drafter, width: int) -> None:
    """Widen DFly's AR head to an inner width of `width` without changing what it computes: the gate and up
    projections get new rows initialised as usual, the down projection new columns that start at zero, so the new
    units add nothing until training moves them."""
    head = getattr(drafter, "ar_head", None)
    if head is None:
        raise ValueError(f"{type(drafter).__name__} has no AR head to widen")
    current = head.down_proj.in_features
    if width < current:
        raise ValueError(f"cannot narrow an AR head: it is {current} wide, {width} asked")
    if width == current:
        return
    device, dtype = head.down_proj.weight.device, head.down_proj.weight.dtype
    for name in ("gate_proj", "up_proj"):
        old = getattr(head, name)
        new = nn.Linear(old.in_features, width, bias=False)
        new.apply(drafter._init_weights)
        new.weight[:current] = old.weight.to(new.weight.dtype)
        setattr(head, name, new.to(device=device, dtype=dtype))
    down = nn.Linear(width, head.down_proj.out_features, bias=False)
    down.weight.zero_()
    down.weight[:, :current] = head.down_proj.weight.to(down.weight.dtype)
    down._zero_init = True
    head.down_proj = down.to(device=device, dtype=dtype)
    drafter.config.ar_head_intermediate_size = width


# ---- the code of a Hub folder ---------------------------------------------------------------------------------------
def save_with_code(drafter, save, save_directory, *args, **kwargs):
    """`save(save_directory, ...)` (`PreTrainedModel.save_pretrained`) with `auto_map` in the config, then the
    family's modeling code (`export_code`), so the folder loads with `trust_remote_code=True` where this library is
    not installed."""
    drafter.config.auto_map = {
        "AutoConfig": f"{type(drafter.config).__module__.rsplit('.', 1)[-1]}.{type(drafter.config).__name__}",
        "AutoModel": f"{type(drafter).__module__.rsplit('.', 1)[-1]}.{type(drafter).__name__}",
    }
    result = save(save_directory, *args, **kwargs)
    if kwargs.get("is_main_process", True):
        export_code(type(drafter), save_directory)
        export_code(type(drafter.config), save_directory)
    return result


_RELATIVE_IMPORT = re.compile(r"^(\s*from\s+)(\.+)([\w.]*)(\s+import)", flags=re.MULTILINE)


def export_code(obj_class, folder) -> list[Path]:
    """Copy the module defining `obj_class` and every module it imports relatively, flattened into `folder`.

    transformers' own `custom_object_save` only follows same-folder imports; our drafters import shared pieces from
    the parent package, so the files are flattened and `from ..a.b import x` is rewritten as `from .b import x`.
    """
    written, pending, seen = [], [obj_class.__module__], set()
    while pending:
        name = pending.pop()
        if name in seen:
            continue
        seen.add(name)
        module = importlib.import_module(name)
        source = Path(module.__file__).read_text(encoding="utf-8")
        for _, dots, rest, _ in _RELATIVE_IMPORT.findall(source):
            if not rest:
                raise ValueError(f"{module.__file__}: use `from .module import x`, not `from . import x`")
            pending.append(importlib.util.resolve_name(dots + rest, module.__package__))
        flat = _RELATIVE_IMPORT.sub(lambda m: f"{m.group(1)}.{m.group(3).split('.')[-1]}{m.group(4)}", source)
        dest = Path(folder) / Path(module.__file__).name
        if dest in written:
            raise ValueError(f"two modules named {dest.name} cannot be flattened into one folder")
        dest.write_text(flat, encoding="utf-8")
        written.append(dest)
    return written


def read_config_dict(path_or_repo, **hub_kwargs) -> dict:
    """`config.json` of a local folder or a Hub id (resolved through the HF cache, so `HF_HUB_OFFLINE=1` works)."""
    if os.path.isdir(path_or_repo):
        return json.loads((Path(path_or_repo) / "config.json").read_text())
    from transformers.utils import cached_file

    return json.loads(Path(cached_file(path_or_repo, "config.json", **hub_kwargs)).read_text())
