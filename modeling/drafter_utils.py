"""What every AngelSpec drafter's Hub folder carries besides its family's files: outputs, the drafting rule, masks and
the base class. The generate() hook and the rest live in the angelspec-hf library, imported only when asked for."""

from __future__ import annotations

import importlib
from dataclasses import dataclass

import torch
from torch import nn
from transformers import DynamicCache
from transformers.modeling_outputs import ModelOutput
from transformers.models.qwen3.modeling_qwen3 import Qwen3PreTrainedModel

IN_LIBRARY = __name__.startswith("angelspec_hf.")  # False for the copy in a Hub folder (`transformers_modules.*`)
NOT_A_CAUSAL_LM = (
    "{name} drafts from the target's hidden states; it is not a causal LM, so transformers' own assisted generation "
    "cannot run it. `target.generate(assistant_model=drafter)` runs it through the angelspec-hf library's generate() "
    "hook: `pip install angelspec-hf`, then `import angelspec_hf`. (A DFlash drafter also runs on transformers' "
    "built-in path without it: `generate(..., assistant_model=drafter, speculation_type=\"dflash\")`.)"
)


def library(module: str):
    """`angelspec_hf.modeling.<module>` (importing the library enables its generate() hook), or an ImportError."""
    try:
        return importlib.import_module(f"angelspec_hf.modeling.{module}")
    except ImportError as error:
        if not (error.name or "").startswith("angelspec_hf"):
            raise
        raise ImportError(f"this needs the angelspec-hf library (its `{module}`), which is not installed: "
                          f"`pip install angelspec-hf` ({error})") from error


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
    """The target's LM head restricted to the target token ids `ids`: only those rows are computed; logits over the
    full vocabulary come out, `-inf` elsewhere (draft probability 0), so every consumer works unchanged."""

    pack = False  # the library's oneDNN-prepacked variant (`drafter_library.PackedPrunedLMHead`) sets it

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

    def scatter(self, sub: torch.Tensor) -> torch.Tensor:
        full = sub.new_full((*sub.shape[:-1], self.vocab_size), float("-inf"))
        return full.index_copy_(-1, self.ids, sub)  # [..., V]

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.scatter(nn.functional.linear(hidden, self.weight, self.bias))  # [..., V_draft] -> [..., V]


@dataclass
class DraftState:
    """A drafter's state for one sequence (`propose`): its KV cache over the accepted context, unpadded."""

    cache: object
    context_length: int = 0  # context positions whose target features are in `cache`

    def prepare(self, num_new: torch.Tensor, block: int, dtype: torch.dtype, num_new_host: int | None = None):
        """`(layer cache, position_ids, attention_mask)` of one forward: the cache and the defaults (None, None)."""
        return self.cache, None, None


def draft_loop(logits_at, num_tokens: int, select, keep_going, anchors: torch.LongTensor):
    """The rule every family drafts by, for a batch: for j = 0, 1, …: the logits of draft position j,
    `logits_at(j, token j - 1)` `[B, V]` (computed only when reached: DFly's AR head and MTP's chained steps are
    sequential), then `select(logits, j) -> (token [B], q, confidence)`, then `keep_going(confidence, j)` (if given):
    stop once it says no or after `num_tokens`. Returns tokens `[B, K]`, the stacked `q` `[B, K, …]` and confidences
    `[B, K]` (each None when `select` gave None), K <= num_tokens; `anchors` `[B]` only shapes the empty result."""
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


def greedy_select(logits: torch.Tensor, j: int):
    """A `select` for `propose`: the argmax, the logits as q, the peak probability."""
    return logits.argmax(-1), logits, torch.softmax(logits.float(), -1).amax(-1)


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


class DrafterPreTrainedModel(Qwen3PreTrainedModel):
    """Base of the drafters: a family implements `draft` and `num_draft_tokens`. Building or loading a drafter
    changes nothing outside it; `import angelspec_hf` enables the library's generate() hook, and the *library* methods
    below raise an ImportError naming `pip install angelspec-hf` where it is not installed."""

    base_model_prefix = "drafter"
    main_input_name = "context_hidden_states"
    _transformers_dflash_layout = False  # DFlash's: the drafter output goes straight into the target's LM head

    def __init__(self, config):
        super().__init__(config)
        self.last_speculation_stats = None
        if config.draft_vocab_size is not None:
            self.register_buffer("draft_vocab_ids", torch.arange(config.draft_vocab_size), persistent=True)

    def __getattr__(self, name: str):
        if name == "generation_config":  # what transformers' own assisted loop reads first off an assistant model
            raise AttributeError(NOT_A_CAUSAL_LM.format(name=type(self).__name__))
        return super().__getattr__(name)

    @property
    def supports_transformers_dflash(self) -> bool:
        """Whether transformers' built-in DFlash path (`speculation_type="dflash"`) can run this drafter."""
        return self._transformers_dflash_layout and self.config.draft_vocab_size is None

    def draft_lm_head(self, lm_head: nn.Module) -> nn.Module:
        """The head drafting uses: `lm_head` itself, or its rows for the pruned draft vocabulary (`draft_vocab_ids`,
        gathered once per head and weight version; oneDNN-prepacked when the library prepacked `lm_head`)."""
        if self.config.draft_vocab_size is None:
            return lm_head
        packed = bool(getattr(lm_head, "packed_for_cpu", False) and getattr(lm_head, "enabled", True))
        key = (id(lm_head), lm_head.weight.data_ptr(), lm_head.weight._version, packed)
        heads = getattr(self, "_draft_heads", None) or {}
        if key not in heads:
            head_class = library("drafter_library").PackedPrunedLMHead if packed else PrunedLMHead
            heads = {key: head_class(lm_head, self.draft_vocab_ids)}  # one target at a time
            self._draft_heads = heads
        return heads[key]

    @property
    def num_draft_tokens(self) -> int:
        raise NotImplementedError

    def new_draft_state(self) -> DraftState:
        return DraftState(cache=DynamicCache(config=self.config))

    def draft(self, context_hidden_states, next_ids, num_new, anchors, num_tokens, embed_tokens, lm_head, select,
              keep_going=None, *, cache):
        r"""The family's one drafting implementation (`propose`; the library's batched engine): ingest each
        sequence's new target features, then draft after its anchor by `draft_loop`'s rule.

        context_hidden_states (`torch.FloatTensor` of shape `(batch_size, n_max, hidden_size * len(target_layer_ids))`):
            Target features of the tokens accepted since the last call; row b's first `num_new[b]` are valid.
        next_ids (`torch.LongTensor` of shape `(batch_size, n_max)`): the token after each of them (MTP's input).
        num_new (`torch.LongTensor` of shape `(batch_size,)`): valid new features per sequence (at least 1).
        anchors (`torch.LongTensor` of shape `(batch_size,)`): the last accepted token, not yet seen by the target.
        select, keep_going: as `draft_loop` calls them; `embed_tokens`, `lm_head` the target's (`draft_lm_head`).
        cache: the drafter's KV store, with `prepare(num_new [B], block, dtype, num_new_host=None) -> (layer cache,
            position_ids, attention_mask)` readying one forward that adds each sequence's `num_new` tokens and then
            `block` transient ones (attended to, not kept); `num_new_host` (an int) says every sequence adds that
            many, so a device cache need not read `num_new` back. Entries of chained steps (MTP) are the caller's
            to drop.

        Returns tokens `(batch_size, K)`, q and confidences `(batch_size, K)` as `draft_loop` does.
        """
        raise NotImplementedError

    def propose(self, state, context_hidden_states, input_ids, num_tokens, embed_tokens, lm_head,
                select=greedy_select, keep_going=None):
        """Draft for one sequence: ingest the features `(1, n, F)` of the tokens after the `state.context_length`
        that `state` (`new_draft_state()`) holds, draft up to `num_tokens` tokens after the anchor `input_ids[:, -1]`,
        then keep only the accepted context in the cache. Returns draft ids `(1, K)` and the stacked `q` of `select`."""
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

    # ---- *library*: the generate() hook, target checks, building, converters, code export ------------------------
    def get_candidate_generator(self, target, input_ids, generation_config, logits_processor=None):
        return library("candidate_generator").AngelSpecCandidateGenerator(self, target, input_ids, generation_config,
                                                                          logits_processor)

    def draft_policy(self, target, cache_dir=None):
        return library("drafter_library").draft_policy(self, target, cache_dir)

    def check_target(self, target) -> None:
        library("drafter_library").check_target(self, target)

    def set_draft_vocab(self, ids) -> None:
        library("drafter_library").set_draft_vocab(self, ids)

    @classmethod
    def from_target(cls, target, **overrides):
        return cls(cls.config_class.from_target(target, **overrides))

    def save_pretrained(self, save_directory, *args, **kwargs):
        """The library's classes also write their code and `auto_map`; a folder's own class is saved by transformers."""
        if not IN_LIBRARY:
            return super().save_pretrained(save_directory, *args, **kwargs)
        return library("drafter_library").save_with_code(self, super().save_pretrained, save_directory, *args, **kwargs)

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *args, **kwargs):
        """The library's classes also convert foreign formats (z-lab DFlash, AngelSpec DFly), keyed on config.json.
        With the library installed, the lookup corpus a folder holds (`lookup_corpus.safetensors`) is attached as
        `lookup_corpus`."""
        if IN_LIBRARY:
            model = library("converters").load_foreign_checkpoint(cls, pretrained_model_name_or_path, **kwargs)
            if model is not None:
                return model
        model = super().from_pretrained(pretrained_model_name_or_path, *args, **kwargs)
        try:  # a folder's own code too, where the library (whose generate() hook looks up in it) is installed
            attach = getattr(library("drafter_library"), "attach_lookup_corpus", None)  # (None: an older library)
        except ImportError:
            attach = None
        if attach is not None:
            attach(model[0] if isinstance(model, tuple) else model, pretrained_model_name_or_path, **kwargs)
        return model
