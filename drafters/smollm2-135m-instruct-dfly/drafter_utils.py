"""What every AngelSpec drafter shares: outputs, drafting state, target checks, code export and foreign loading."""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from transformers import DynamicCache
from transformers.modeling_outputs import ModelOutput
from transformers.models.qwen3.modeling_qwen3 import Qwen3PreTrainedModel

from .candidate_generator import AngelSpecCandidateGenerator, install_generate_hook
from .draft_policy import DraftLengthPolicy, hardware_key, load_or_profile_round_costs, packed_linear


@dataclass
class DrafterOutput(ModelOutput):
    r"""
    last_hidden_state (`torch.FloatTensor` of shape `(batch_size, sequence_length, hidden_size)`):
        Drafter output after its final norm, ready for the target's LM head.
    logits (`torch.FloatTensor` of shape `(batch_size, sequence_length, vocab_size)`, *optional*):
        Draft logits, when the drafter was given the target's LM head.
    cache (`transformers.Cache`, *optional*):
        The drafter's KV cache.
    """

    last_hidden_state: torch.FloatTensor | None = None
    logits: torch.FloatTensor | None = None
    cache: object | None = None


class PrunedLMHead(nn.Module):
    """The target's LM head restricted to a drafter's vocabulary subset `ids`: `forward` returns logits over the full
    vocabulary, `-inf` outside the subset, so a token outside has draft probability 0 and every consumer (logits
    processors, greedy match, rejection sampling with q = 0 there) works unchanged. Only `len(ids)` rows are computed.

    When the target's head reads oneDNN-prepacked weights (`angelspec_hf.prepack_linears`, marked `packed_for_cpu`),
    the gathered rows are prepacked too: on the CPU, `F.linear` of one row against the 8,192 x 576 rows took 1.80 ms
    and the prepacked kernel 0.54 ms (2 threads, `outputs/s28/head_gemv.py`), and drafting runs it once per position."""

    def __init__(self, lm_head: nn.Module, ids: torch.LongTensor):
        super().__init__()
        weight = lm_head.weight.detach()
        if int(ids.max()) >= weight.shape[0] or int(ids.min()) < 0:
            raise ValueError(f"draft vocabulary ids reach {int(ids.max())}, outside the target's vocabulary "
                             f"({weight.shape[0]})")
        self.ids = ids.to(weight.device)
        self.weight = weight[self.ids]  # [V_draft, H], gathered once
        bias = getattr(lm_head, "bias", None)
        self.bias = None if bias is None else bias.detach()[self.ids]
        self.vocab_size = weight.shape[0]
        self.pack = packed_linear(lm_head) and self.weight.device.type == "cpu" and self.weight.dtype == torch.float32
        self.packed = None  # made at first use

    def __getstate__(self):  # the packed copy is an opaque oneDNN tensor: copies and pickles pack again when used
        return {**super().__getstate__(), "packed": None}

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.pack and hidden.dtype == torch.float32 and hidden.device.type == "cpu" and hidden.numel() \
                and not (torch.is_grad_enabled() and hidden.requires_grad):
            if self.packed is None:
                self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight, None)
            sub = torch.ops.mkldnn._linear_pointwise(hidden.contiguous(), self.packed, self.bias, "none", [], "")
        else:
            sub = nn.functional.linear(hidden, self.weight, self.bias)  # [..., V_draft]
        full = sub.new_full((*sub.shape[:-1], self.vocab_size), float("-inf"))
        return full.index_copy_(-1, self.ids, sub)  # [..., V]


@dataclass
class DraftState:
    """A drafter's per-sequence state in a `generate()` call: its KV cache over the accepted context. It is the
    hook's *draft cache* (`DrafterPreTrainedModel.draft`): one sequence, nothing padded, so the drafter's default
    positions (following the cache) and masks (causal, or a whole DFlash block) apply."""

    cache: object
    context_length: int = 0  # context positions whose target features are in `cache`

    def prepare(self, num_new: torch.Tensor, block: int, dtype: torch.dtype):
        """`(layer cache, position_ids, attention_mask)` for one drafter forward: the transformers cache itself, and
        None, None (the defaults). Entries past `context_length` (a block, chained steps) are dropped by `propose`."""
        return self.cache, None, None


def draft_loop(logits_at, num_tokens: int, select, keep_going, anchors: torch.LongTensor):
    """The rule every family drafts by, for a batch: for j = 0, 1, …: the logits of draft position j,
    `logits_at(j, token j - 1)` `[B, V]` (computed only when reached: DFly's AR head and MTP's chained steps are
    sequential), then `select(logits, j) -> (token [B], q, confidence)`, then `keep_going(confidence, j)` (if given):
    stop once it says no (so a position no sequence could use is not computed) or after `num_tokens`.

    Returns tokens `[B, K]`, the stacked `q` `[B, K, …]` and confidences `[B, K]` (each None when `select` gave None),
    K <= num_tokens; `anchors` `[B]` only shapes the empty result."""
    steps, token = [], None
    for j in range(num_tokens):
        token, q, confidence = select(logits_at(j, token), j)
        steps.append((token, q, confidence))
        if keep_going is not None and not keep_going(confidence, j):
            break
    if not steps:
        empty = anchors.new_zeros(anchors.shape[0], 0)
        return empty, None, empty.float()
    tokens, qs, confidences = zip(*steps)
    return (torch.stack(tokens, 1), None if qs[0] is None else torch.stack(qs, 1),
            None if confidences[0] is None else torch.stack(confidences, 1))


def additive_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean mask (True = may attend) as an additive one: 0 where allowed, the dtype's minimum elsewhere."""
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill(~allowed, torch.finfo(dtype).min)


def padding_to_additive_mask(attention_mask, query_length: int, dtype: torch.dtype):
    """A 2-D keep-mask `[B, kv]` → additive `[B, 1, q, kv]` (None when nothing is masked); 4-D passes through."""
    if attention_mask is None or attention_mask.dim() == 4:
        return attention_mask
    if bool(attention_mask.all()):
        return None
    return additive_mask(attention_mask[:, None, None, :].bool().expand(-1, 1, query_length, -1), dtype)


def causal_additive_mask(query_length: int, past_length: int, dtype, device) -> torch.Tensor:
    """`[1, 1, q, past + q]` additive mask: query i sees every cached key and new keys 0..i."""
    kv = past_length + query_length
    allowed = torch.arange(kv, device=device)[None, :] <= (past_length + torch.arange(query_length, device=device))[:, None]
    return additive_mask(allowed, dtype)[None, None]


class DrafterPreTrainedModel(Qwen3PreTrainedModel):
    """Base of the drafters. Subclasses implement `draft` (drafting) and `num_draft_tokens`."""

    base_model_prefix = "drafter"
    main_input_name = "context_hidden_states"
    _transformers_dflash_layout = False  # DFlash's: the drafter output goes straight into the target's LM head

    def __init__(self, config):
        super().__init__(config)
        install_generate_hook()
        self.last_speculation_stats = None
        if config.draft_vocab_size is not None:
            self.register_buffer("draft_vocab_ids", torch.arange(config.draft_vocab_size), persistent=True)

    # ---- the draft vocabulary ------------------------------------------------------------------------------------
    def set_draft_vocab(self, ids) -> None:
        """Restrict drafting to the target token ids `ids` (sorted, deduplicated); `None` restores the whole
        vocabulary. Saved with the weights (`draft_vocab_ids`) and in the config (`draft_vocab_size`)."""
        self._draft_heads = {}
        if ids is None:
            self.config.draft_vocab_size = None
            self._buffers.pop("draft_vocab_ids", None)
            return
        ids = torch.unique(torch.as_tensor(ids, dtype=torch.long))
        if len(ids) == 0 or int(ids.min()) < 0 or int(ids.max()) >= self.config.vocab_size:
            raise ValueError(f"draft vocabulary ids must be non-empty and in [0, {self.config.vocab_size})")
        self.config.draft_vocab_size = len(ids)
        self.register_buffer("draft_vocab_ids", ids.to(self.device), persistent=True)

    @property
    def supports_transformers_dflash(self) -> bool:
        return self._transformers_dflash_layout and self.config.draft_vocab_size is None

    def draft_lm_head(self, lm_head: nn.Module) -> nn.Module:
        """The head drafting uses: `lm_head` itself, or its rows for the pruned draft vocabulary (gathered once per
        head and weight version)."""
        if self.config.draft_vocab_size is None:
            return lm_head
        key = (id(lm_head), lm_head.weight.data_ptr(), lm_head.weight._version, packed_linear(lm_head))
        heads = getattr(self, "_draft_heads", None) or {}
        if key not in heads:
            heads = {key: PrunedLMHead(lm_head, self.draft_vocab_ids)}  # one target at a time
            self._draft_heads = heads
        return heads[key]

    # ---- building ------------------------------------------------------------------------------------------------
    @classmethod
    def from_target(cls, target, **overrides):
        """A freshly initialised drafter whose config fits `target` (a model or its config); `overrides` win."""
        return cls(cls.config_class.from_target(target, **overrides))

    def check_target(self, target) -> None:
        """Raise a `ValueError` naming both values when this drafter cannot read/serve `target`."""
        tc = (target.config if hasattr(target, "config") else target).get_text_config()
        c = self.config
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

    def get_candidate_generator(self, target, input_ids, generation_config, logits_processor=None):
        return AngelSpecCandidateGenerator(self, target, input_ids, generation_config, logits_processor)

    def draft_policy(self, target, cache_dir=None) -> DraftLengthPolicy:
        """The `generate()` hook's draft-length policy for `target` on this hardware: round costs profiled once and
        cached (`draft_policy.py`), acceptance learned across calls. Kept on the drafter, one per target/hardware."""
        key = hardware_key(target, self)
        policy = getattr(self, "_draft_policies", {}).get(key)
        if policy is None:
            costs = load_or_profile_round_costs(target, self, cache_dir)
            policy = DraftLengthPolicy(costs, self.num_draft_tokens)
            self._draft_policies = {key: policy}  # a new target or machine replaces the old one
        return policy

    @property
    def num_draft_tokens(self) -> int:
        raise NotImplementedError

    def new_draft_state(self) -> DraftState:
        return DraftState(cache=DynamicCache(config=self.config))

    def draft(self, context_hidden_states, next_ids, num_new, anchors, num_tokens, embed_tokens, lm_head, select,
              keep_going=None, *, cache):
        r"""The family's drafting, one implementation for the `generate()` hook (`propose`: batch 1, `DraftState`)
        and the batched engine (`tgi_patch`: a paged KV pool): ingest each sequence's new target features, then draft
        after its anchor by `draft_loop`'s rule.

        context_hidden_states (`torch.FloatTensor` of shape `(batch_size, n_max, hidden_size * len(target_layer_ids))`):
            Target features of the tokens accepted since the last call; row b's first `num_new[b]` are valid.
        next_ids (`torch.LongTensor` of shape `(batch_size, n_max)`): the token after each of them (MTP's input).
        num_new (`torch.LongTensor` of shape `(batch_size,)`): valid new features per sequence (at least 1).
        anchors (`torch.LongTensor` of shape `(batch_size,)`): the last accepted token, not yet seen by the target.
        select, keep_going: as `draft_loop` calls them; `embed_tokens`, `lm_head` the target's (`draft_lm_head`).
        cache: the drafter's KV store, with `prepare(num_new [B], block, dtype) -> (layer cache, position_ids,
            attention_mask)` readying one forward that adds each sequence's `num_new` tokens and then `block`
            transient ones (attended to, not kept). Entries of chained steps (MTP) are the caller's to drop.

        Returns tokens `(batch_size, K)`, q and confidences `(batch_size, K)` as `draft_loop` does.
        """
        raise NotImplementedError

    def propose(self, state, context_hidden_states, input_ids, num_tokens, embed_tokens, lm_head, select,
                keep_going=None):
        """The `generate()` hook's drafting: ingest the target features `(batch_size, n, F)` of the tokens after the
        `state.context_length` that `state` holds, draft up to `num_tokens` tokens after the anchor `input_ids[:, -1]`
        (`draft`), then keep only the accepted context in the cache. Returns draft ids `(batch_size, K)` and the
        stacked `q` of `select` (the hook's: processed draft logits `(batch_size, K, vocab_size)`; None when K = 0)."""
        start, num_new = state.context_length, context_hidden_states.shape[1]
        tokens, q, _ = self.draft(
            context_hidden_states, input_ids[:, start + 1 : start + 1 + num_new],
            input_ids.new_full((input_ids.shape[0],), num_new), input_ids[:, -1], num_tokens, embed_tokens, lm_head,
            select, keep_going, cache=state,
        )
        state.context_length += num_new
        extra = state.cache.get_seq_length() - state.context_length  # the block or chained entries
        if extra:
            state.cache.crop(-extra)
        return tokens, q

    def _init_weights(self, module):
        super()._init_weights(module)
        if getattr(module, "_zero_init", False):
            from transformers import initialization as init

            init.zeros_(module.weight)

    # ---- saving and loading --------------------------------------------------------------------------------------
    def save_pretrained(self, save_directory, *args, **kwargs):
        """`PreTrainedModel.save_pretrained` (safetensors) plus the modeling code and `auto_map`, so the folder loads
        with `trust_remote_code=True` where this library is not installed."""
        self.config.auto_map = {
            "AutoConfig": f"{type(self.config).__module__.rsplit('.', 1)[-1]}.{type(self.config).__name__}",
            "AutoModel": f"{type(self).__module__.rsplit('.', 1)[-1]}.{type(self).__name__}",
        }
        super().save_pretrained(save_directory, *args, **kwargs)
        if kwargs.get("is_main_process", True):
            export_code(type(self), save_directory)
            export_code(type(self.config), save_directory)

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *args, **kwargs):
        """Native checkpoints load as usual; foreign formats (z-lab DFlash, AngelSpec DFly) are converted, keyed on
        their `config.json` (see `modeling/converters.py`). The converters are the library's, imported by name so
        that an exported folder's code (`export_code` follows `from .x import` lines) carries only its own family:
        a folder loaded with `trust_remote_code=True` is native and has no converters to look for."""
        try:
            converters = importlib.import_module(".converters", __package__)
        except ModuleNotFoundError as exc:
            if exc.name != f"{__package__}.converters":
                raise
            converters = None  # the code of an exported folder
        if converters is not None:
            model = converters.load_foreign_checkpoint(cls, pretrained_model_name_or_path, **kwargs)
            if model is not None:
                return model
        return super().from_pretrained(pretrained_model_name_or_path, *args, **kwargs)


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
