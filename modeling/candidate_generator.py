"""The seam between a stock `target.generate(assistant_model=drafter)` and an AngelSpec drafter.

transformers' assisted generation asks `GenerationMixin._get_candidate_generator` for a `CandidateGenerator`; its
built-in choices are either a full causal-LM assistant (which never sees the target's hidden states) or the DFlash
path (`speculation_type="dflash"`, whose drafter output must go straight into the target's LM head, which rules out
DFly's autoregressive head and MTP's step-by-step drafting). So the drafter brings its own generator:
`AngelSpecCandidateGenerator` uses transformers' public candidate-generator contract (`requires_model_outputs`,
`model_kwargs_overrides` asking the target for exactly the hidden states the drafter reads), and the target still
verifies with transformers' own code (greedy match, or `_speculative_sampling` with the draft logits we return).

The one private piece is the routing: `enable_generate_hook()` wraps `GenerationMixin._get_candidate_generator`
(and the mode validation that runs before it), process-wide, so that an AngelSpec drafter passed as `assistant_model`
gets its generator, and every other assistant falls through unchanged. `import angelspec_hf` enables it (and nothing
else does: constructing or loading a drafter changes no other class); `disable_generate_hook()` restores transformers'
own methods. This file belongs to the library: a drafter's Hub folder does not carry it. The wrapped signatures are
checked by `tests/test_generate_hook.py` for the pinned transformers range.
"""

from __future__ import annotations

import functools
import inspect
import time
import weakref
from dataclasses import dataclass, field

import torch
from transformers.generation import GenerationMixin
from transformers.generation.candidate_generator import CandidateGenerator

from angelspec_hf.attention import use_gqa_sdpa
from angelspec_hf.policy import NgramIndex, clock

from .draft_policy import decoding_mode

BATCHED_API = "angelspec_hf.generate_batch(target, drafter, prompts, verify=...)"


def acceptance_probability(target_logits: torch.Tensor, draft_probs: torch.Tensor) -> float:
    """The probability that speculative sampling accepts a draft token drawn from `draft_probs` (q) where the target's
    processed logits are `target_logits` (p = their softmax): `sum_x q(x) min(1, p(x) / q(x)) = sum_x min(p(x), q(x))`."""
    p = torch.softmax(target_logits.float(), dim=-1)
    return float(torch.minimum(p, draft_probs.to(p.device, torch.float32)).sum())


def draw_token(probs: torch.Tensor, ids: torch.LongTensor | None = None) -> torch.Tensor:
    """One token id per row of `probs` `[B, V]`, drawn from it with the global random generator (`torch.manual_seed`
    sets it), by inverse CDF (`sample_from`): exact, never a token of probability zero, and over a 49k vocabulary
    ~0.06 ms where `torch.multinomial` takes ~1.3 ms on a 2-core CPU. `ids` `[V]`: the token id of each column (a
    pruned draft vocabulary's rows); None: the column index is the id."""
    from angelspec_hf.tgi_patch.engine.sampling import sample_from  # here: the engine imports this module

    index = sample_from(probs, torch.rand(probs.shape[0], device=probs.device))
    return index if ids is None else ids[index]


@functools.cache
def row_processors() -> tuple[type, ...]:
    """transformers' logits processors whose output at a token depends only on the row's values, never on token ids
    or the context, and which leave -inf entries at -inf: applied to a pruned head's rows alone they give that row's
    entries of their output over the full vocabulary (whose other entries are -inf, probability zero)."""
    from transformers.generation import logits_process as lp

    return (lp.TemperatureLogitsWarper, lp.TopKLogitsWarper, lp.TopPLogitsWarper, lp.MinPLogitsWarper)


def mean_accepted_length(accepted: int, rounds: int) -> float:
    """τ: tokens gained per target forward over `rounds` verification rounds that accepted `accepted` draft tokens in
    all, the bonus/correction token of each round included; NaN without rounds."""
    return (accepted + rounds) / rounds if rounds else float("nan")


@dataclass
class SpeculationStats:
    """What one `generate()` call did, per verification round: how many draft tokens were proposed and accepted, the
    drafted token ids and the drafter's (processed) probability of each."""

    proposed: list[int] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)
    drafts: list[list[int]] = field(default_factory=list)
    draft_probs: list[list[float]] = field(default_factory=list)
    plain_steps: int = 0  # target forwards without a draft (`draft_length="auto"` found drafting would not pay)
    shadow_probes: int = 0  # plain steps beside which the drafter proposed a token only to learn its acceptance
    lookup_rounds: int = 0  # rounds that verified a lookup instead of the drafter's block (`lookup_tokens`)
    corpus_rounds: int = 0  # of those, rounds that verified a corpus lookup (`drafter.lookup_corpus`)
    draft_seconds: float = 0.0  # time spent drafting (the drafter's forwards and token choices)

    @property
    def rounds(self) -> int:
        return len(self.accepted)

    @property
    def mean_accepted_length(self) -> float:
        """τ: tokens gained per target forward, the bonus/correction token included."""
        return mean_accepted_length(sum(self.accepted), self.rounds)


class AngelSpecCandidateGenerator(CandidateGenerator):
    """Feeds the target's hidden states to an AngelSpec drafter and returns its draft (and draft logits).

    The drafter keeps its own state (`drafter.new_draft_state()`): a KV cache over the accepted context and the number
    of context positions it has ingested. Each call ingests the target features of the tokens accepted since the last
    call, then drafts up to `drafter.num_draft_tokens` tokens after the last token of `input_ids` (the anchor).
    """

    requires_model_outputs = True

    def __init__(self, drafter, target, input_ids, generation_config, logits_processor=None):
        if input_ids.shape[0] != 1:
            raise ValueError(
                f"target.generate(assistant_model=...) drafts for one sequence at a time (transformers' assisted "
                f"generation is batch-1 only), got batch size {input_ids.shape[0]}. For batches use the batched "
                f"engine: {BATCHED_API}."
            )
        drafter.check_target(target)
        if target.device.type == "cpu":
            use_gqa_sdpa(target)  # same outputs as SDPA, each verify forward without copies of the KV cache
        self.drafter = drafter
        self.target_embeddings = target.get_input_embeddings()
        self.target_lm_head = drafter.draft_lm_head(target.get_output_embeddings())  # pruned rows, if any
        row_wise = all(type(p) in row_processors() for p in (logits_processor or ()))
        # a pruned head's target ids (sorted): `_select` works on these rows alone; None: over the full vocabulary
        self._draft_ids = getattr(self.target_lm_head, "ids", None) if row_wise else None
        self.vocab_size = target.get_output_embeddings().weight.shape[0]
        self.lookup_tokens = int(getattr(drafter.config, "lookup_tokens", 0) or 0)
        self.lookup_max_ngram = int(getattr(drafter.config, "lookup_max_ngram", 3) or 3)
        self._ngrams: NgramIndex | None = None  # the context's n-gram index, extended as tokens are accepted
        # a corpus of the target's earlier outputs to look up in (`angelspec_hf.policy.CorpusIndex`), with lookups on
        self.corpus = getattr(drafter, "lookup_corpus", None) if self.lookup_tokens else None
        self._repeating = False  # the round before verified a lookup and accepted all of it
        # a corpus that grows with the replies served (`angelspec_hf.policy.GrowingCorpus`): a greedy call's prompt
        # tail and reply join it when the call ends (this generator is released); sampled replies never do, since
        # their draws come from torch's random stream, which a caller who reseeds it hands to the next call too
        self._reply = None
        if callable(getattr(self.corpus, "add", None)) and not generation_config.do_sample:
            self._reply = [input_ids]  # the sequence as last verified (`update_candidate_strategy`)
            weakref.finalize(self, _add_reply, self.corpus, self._reply, input_ids.shape[1]).atexit = False
        self.max_length = generation_config.max_length
        self.do_sample = bool(generation_config.do_sample)
        self.logits_processor = logits_processor
        # "auto": a cost-aware number of draft tokens per round (none when drafting does not pay); "full": whole
        # blocks, cut by the fixed confidence threshold when one is set. Either way sampling stays exact: whether
        # position j + 1 is drafted (and so verified) is decided after the token at j is drawn, never from the token
        # at j + 1, and whether a round drafts at all from earlier rounds only.
        auto = getattr(drafter.config, "draft_length", "auto") == "auto"
        self.policy = drafter.draft_policy(target) if auto else None
        if self.policy is not None:
            self.policy.new_sequence(decoding_mode(generation_config))
        self.stop_threshold = 0.0 if auto else float(getattr(drafter.config, "draft_stop_threshold", 0.0) or 0.0)
        self._survival = 1.0
        self._max_tokens, self._round_probs = 0, []
        self._prefix = input_ids  # the context and the tokens drafted so far, for the logits processors
        self._pending: list[torch.Tensor] = []  # target features kept from plain rounds, not yet given to the drafter
        self._pending_length = 0
        self._round = {"drafted": 0, "draft_seconds": None, "returned_at": None, "lookup": None, "corpus": False,
                       "shadow": None}
        self._last_round_end: float | None = None
        self.model_kwargs_overrides = {"output_hidden_states": [i + 1 for i in drafter.config.target_layer_ids]}
        self.state = drafter.new_draft_state()
        self.stats = SpeculationStats()
        drafter.last_speculation_stats = self.stats

    def _processed(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Draft logits processed like the target's (same processors, over the context and the tokens drafted so far),
        and their softmax."""
        logits = logits.float()
        if self.logits_processor is not None and len(self.logits_processor) > 0:
            logits = self.logits_processor(self._prefix, logits)
        return logits, torch.softmax(logits, dim=-1)

    def _select(self, logits: torch.Tensor, j: int):
        """`select` for `drafter.draft`: process draft position j's logits like the target's, then pick: argmax or a
        sample (`draw_token`). Returns `(token, processed logits, peak probability)`.

        With a pruned head (`PrunedLMHead`: -inf outside the draft vocabulary) and no processor, or only processors
        that read nothing but the row's own values (`row_processors()`: temperature, top-k, top-p, min-p), the work is
        done on the draft vocabulary's rows alone: the same token and distribution as over the full vocabulary, whose
        other entries stay -inf, without the passes over all of it (`benchmarks/draft_choice.py`: on a 2-core CPU
        0.04 against 0.10 ms a position greedy, 0.22 against 0.51 ms sampling with top-k 50). Greedy without processors
        takes the argmax and the peak in one pass over the probabilities."""
        ids = self._draft_ids
        if not self.do_sample and not self.logits_processor:
            rows = logits if ids is None else logits.index_select(-1, ids)
            peak, column = torch.softmax(rows.float(), dim=-1).max(dim=-1)
            token = column if ids is None else ids[column]
            self._prefix = torch.cat([self._prefix, token[:, None]], dim=-1)
            self._round_probs.append(float(peak[0]))
            return token, logits, peak
        if ids is not None and self.do_sample:
            rows = logits.index_select(-1, ids).float()
            if self.logits_processor:
                rows = self.logits_processor(self._prefix, rows)
            probs = torch.softmax(rows, dim=-1)
            token = draw_token(probs, ids)
            peak = probs.max(dim=-1).values
            column = torch.searchsorted(ids, token[:1]).clamp(max=len(ids) - 1)  # the drawn token's row
            self._round_probs.append(float(probs[0, column[0]]) if ids[column[0]] == token[0] else 0.0)
            logits = rows.new_full(logits.shape, float("-inf")).index_copy_(-1, ids, rows)
        else:
            logits, probs = self._processed(logits)
            token = draw_token(probs) if self.do_sample else logits.argmax(dim=-1)
            peak = probs.max(dim=-1).values
            self._round_probs.append(float(probs[0, token[0]]))
        self._prefix = torch.cat([self._prefix, token[:, None]], dim=-1)
        return token, logits, peak

    def _keep_going(self, peak: torch.Tensor, j: int) -> bool:
        """`keep_going` for `drafter.draft`, after position j is drawn: the draft-length policy's verdict from the
        peak there, or (fixed lengths) whether the drafter's own probability of its draft so far is still at least
        `config.draft_stop_threshold`."""
        if self.policy is not None:
            return self.policy.keep_drafting(float(peak[0]), self._max_tokens)
        self._survival = self._survival * self._round_probs[j]
        return self._survival >= self.stop_threshold

    @torch.no_grad()
    def get_candidates(self, input_ids, model_kwargs=None, model_outputs=None, is_first_iteration=False, **kwargs):
        if is_first_iteration:  # the first target pass is the prefill: nothing to draft from yet
            return input_ids, None
        if model_outputs is None or getattr(model_outputs, "hidden_states", None) is None:
            raise ValueError("AngelSpec drafting needs the target's hidden states from the previous forward")
        drafter_device = self.drafter.device
        # Tokens whose target features are new: everything accepted since the last call, the anchor excluded.
        num_new = input_ids.shape[1] - 1 - self.state.context_length - self._pending_length
        context = torch.cat(
            [model_outputs.hidden_states[i + 1][:, :num_new] for i in self.drafter.config.target_layer_ids], dim=-1
        ).to(drafter_device)
        num_tokens = max(0, min(self.drafter.num_draft_tokens, self.max_length - input_ids.shape[1] - 1))
        self._survival, self._max_tokens, self._round_probs = 1.0, num_tokens, []
        self._round.update(drafted=0, draft_seconds=None, lookup=None, corpus=False, shadow=None)
        lookup = self._lookup(input_ids, num_tokens)
        if lookup is not None or (self.policy is not None and not self.policy.start_round(num_tokens)):
            if lookup is None and self.policy is not None and self.policy.shadow_due:
                self._shadow_draft(input_ids, self._catch_up(context))
            else:
                self._pending.append(context)  # no drafting: the drafter reads these features when it next drafts
                self._pending_length += num_new
            self._round["returned_at"] = time.perf_counter()
            if lookup is None:
                self.stats.plain_steps += int(num_tokens > 0)
                return input_ids, None
            return lookup
        context = self._catch_up(context)
        start = clock(drafter_device)
        self._prefix = input_ids.to(drafter_device)
        draft_ids, draft_logits = self.drafter.propose(
            self.state,
            context_hidden_states=context,
            input_ids=self._prefix,
            num_tokens=num_tokens,
            embed_tokens=self.target_embeddings,
            lm_head=self.target_lm_head,
            select=self._select,
            keep_going=self._keep_going,
        )
        drafted_at = clock(drafter_device)  # the drafter's queued kernels have run: its time, not the target's
        self._round.update(drafted=draft_ids.shape[1], draft_seconds=drafted_at - start)
        self.stats.draft_seconds += self._round["draft_seconds"]
        if num_tokens == 0:
            return input_ids, None
        self.stats.proposed.append(draft_ids.shape[1])
        self.stats.drafts.append(draft_ids[0].tolist())
        self.stats.draft_probs.append(self._round_probs)
        candidates = torch.cat([input_ids, draft_ids.to(input_ids.device)], dim=-1)
        self._round["returned_at"] = drafted_at
        return candidates, draft_logits.to(input_ids.device)

    def _catch_up(self, context: torch.Tensor) -> torch.Tensor:
        """`context` preceded by the features kept from plain rounds, which the drafter is about to read."""
        if self._pending:
            context = torch.cat(self._pending + [context], dim=1)
            self._pending, self._pending_length = [], 0
        return context

    def _shadow_draft(self, input_ids, context) -> None:
        """A probe beside this round's plain step (`DraftLengthPolicy`): the drafter ingests `context` and proposes
        its first token, which is not verified; `update_candidate_strategy` scores it against the target's distribution
        at the step. Its token is the drafter's argmax even when sampling: nothing here draws a random number, so the
        generation's random stream is the one it would have been without the probe."""
        shadow = {}

        def select(logits, j):
            logits, probs = self._processed(logits)
            peak, token = probs.max(dim=-1)
            shadow.update(token=int(token[0]), probs=probs[0], confidence=float(peak[0]))
            return token, None, peak

        start = clock(self.drafter.device)
        self._prefix = input_ids.to(self.drafter.device)
        self.drafter.propose(self.state, context_hidden_states=context, input_ids=self._prefix, num_tokens=1,
                             embed_tokens=self.target_embeddings, lm_head=self.target_lm_head, select=select)
        seconds = clock(self.drafter.device) - start
        self._round.update(shadow=shadow, draft_seconds=seconds)
        self.stats.shadow_probes += 1
        self.stats.draft_seconds += seconds

    def _score_shadow(self, input_ids, scores) -> float:
        """The probability that the shadow draft's token would have been accepted at the step just verified: greedy,
        whether the target chose it; sampling, `acceptance_probability` of the drafter's q against the target's
        processed distribution there."""
        shadow = self._round["shadow"]
        if not self.do_sample:
            return float(int(input_ids[0, -1]) == shadow["token"])
        return acceptance_probability(scores[0, -1], shadow["probs"])

    def _lookup(self, input_ids, num_tokens):
        """A lookup round, `(candidates, one-hot logits)`, when one is on offer and expected to beat both the drafter's
        block and a plain step; else None. Two lookups can propose: the n-gram lookup in the context, and with a corpus
        attached to the drafter (`drafter.lookup_corpus`, a `CorpusIndex`) the corpus lookup; under the cost-aware
        policy the one with the better expected rate is verified (the n-gram lookup, whole, while the text repeats a
        span of its context). Without the policy (`draft_length="full"`) only an n-gram lookup matched on 2+ tokens
        is verified. A lookup is a deterministic proposal, q = one-hot on its token, so transformers' speculative
        sampling accepts token x with probability p(x) and otherwise draws from p without x: exact. Whether and how
        far to look up depends on the context and past rounds only."""
        room = max(0, self.max_length - input_ids.shape[1] - 1)
        if not self.lookup_tokens or room == 0:
            return None
        ids, limit = input_ids[0], min(self.lookup_tokens, room)
        if self._ngrams is None or len(self._ngrams.ids) > len(ids):
            self._ngrams = NgramIndex(self.lookup_max_ngram)
        self._ngrams.extend_to(ids)  # the accepted context only grows: only its new tokens are indexed
        tokens, n = self._ngrams.continuation(limit)
        confidence = n / self.lookup_max_ngram
        corpus = False
        if self.policy is None:
            tokens = tokens if n >= 2 else []
        else:
            k = (self.policy.lookup_length(confidence, len(tokens), num_tokens, repeating=self._repeating)
                 if tokens else 0)
            if self.corpus is not None and not (k and self._repeating):
                found, confidences = self.corpus.continuation(ids, limit)
                corpus_k, corpus_rate = self.policy.lookup_plan(confidences, num_tokens, corpus=True)
                if corpus_k and (not k or corpus_rate > self.policy.lookup_rate([confidence] * k)):
                    tokens, k, corpus, confidence = found, corpus_k, True, confidences[:corpus_k]
            tokens = tokens[:k]
        if not tokens:
            return None
        draft = torch.tensor([tokens], dtype=input_ids.dtype, device=input_ids.device)
        logits = torch.full((1, len(tokens), self.vocab_size), float("-inf"), device=input_ids.device)
        logits.scatter_(-1, draft[..., None], 0.0)
        self._round.update(drafted=len(tokens), lookup=confidence, corpus=corpus)
        self.stats.lookup_rounds += 1
        self.stats.corpus_rounds += int(corpus)
        self.stats.proposed.append(len(tokens))
        self.stats.drafts.append(tokens)
        self.stats.draft_probs.append([1.0] * len(tokens))
        return torch.cat([input_ids, draft], dim=-1), logits

    def update_candidate_strategy(self, input_ids, scores, num_matches):
        returned_at, now = self._round["returned_at"], time.perf_counter()
        if self.policy is not None and returned_at is not None:  # the target forward and verification just timed
            if self._round["lookup"] is not None:
                self.policy.observe_lookup(self._round["lookup"], self._round["drafted"], int(num_matches),
                                           now - returned_at, corpus=self._round["corpus"])
            elif self._round["shadow"] is not None:  # a plain step with a probe beside it: not a plain round's rate
                self.policy.observe_shadow(self._round["shadow"]["confidence"], self._score_shadow(input_ids, scores),
                                           self._round["draft_seconds"])
                self.policy.observe(0, 0, None, now - returned_at)
            else:  # a whole round's wall time: from the end of the round (or prefill) before to now
                round_seconds = None if self._last_round_end is None else now - self._last_round_end
                self.policy.observe(self._round["drafted"], int(num_matches), self._round["draft_seconds"],
                                    now - returned_at, round_seconds)
        if self._reply is not None:
            self._reply[0] = input_ids
        self._repeating = (self._round["lookup"] is not None and not self._round["corpus"]
                           and int(num_matches) >= self._round["drafted"])
        self._round["returned_at"], self._last_round_end = None, now
        if len(self.stats.accepted) < len(self.stats.proposed):
            self.stats.accepted.append(int(num_matches))


def _add_reply(corpus, reply: list, prompt_length: int) -> None:
    """A finished greedy call's reply (`reply[0]`: the sequence as last verified, `[1, length]`) joins a growing
    corpus, after the last `corpus.max_match` tokens of its prompt (what a later context must match to propose it)."""
    ids = reply[0][0]
    if ids.shape[0] > prompt_length:
        corpus.add(ids[max(0, prompt_length - getattr(corpus, "max_match", 0)):].cpu())


def _is_angelspec_drafter(model) -> bool:
    return model is not None and callable(getattr(model, "get_candidate_generator", None))


def generate_hook_enabled() -> bool:
    """Whether `enable_generate_hook()` has wrapped `GenerationMixin`'s two methods (and nothing has undone it)."""
    return "_angelspec_original" in getattr(GenerationMixin._get_candidate_generator, "__dict__", {})


def disable_generate_hook() -> None:
    """Give `GenerationMixin` back transformers' own two methods (idempotent). AngelSpec drafters then run only on
    transformers' own paths (a DFlash drafter with `speculation_type="dflash"`)."""
    for name in ("_get_candidate_generator", "_validate_generation_mode"):
        original = getattr(GenerationMixin, name).__dict__.get("_angelspec_original")
        if original is not None:
            setattr(GenerationMixin, name, original)


def enable_generate_hook() -> None:
    """Route `target.generate(assistant_model=<AngelSpec drafter>)` to the drafter's own candidate generator, for
    every model of this process (idempotent): `GenerationMixin._get_candidate_generator` and
    `_validate_generation_mode` are wrapped; every other assistant falls through to transformers unchanged. `import
    angelspec_hf` calls it."""
    if generate_hook_enabled():
        return
    original_get = GenerationMixin._get_candidate_generator
    original_validate = GenerationMixin._validate_generation_mode
    get_signature = inspect.signature(original_get)
    validate_signature = inspect.signature(original_validate)

    @functools.wraps(original_validate)
    def _validate_generation_mode(self, *args, **kwargs):
        bound = validate_signature.bind(self, *args, **kwargs)
        mode_kwargs = bound.arguments.get("generation_mode_kwargs") or {}
        drafter = mode_kwargs.get("assistant_model")
        if _is_angelspec_drafter(drafter):
            # Our errors first: they name both values, where transformers' would speak of tokenizers.
            drafter.check_target(self)
            generation_config = bound.arguments["generation_config"]
            if generation_config.speculation_type == "dflash" and not drafter.supports_transformers_dflash:
                raise ValueError(
                    f"speculation_type='dflash' runs transformers' built-in DFlash drafting, which "
                    f"{type(drafter).__name__} does not fit (only a DFlash drafter over the whole vocabulary does); "
                    f"drop speculation_type to use its own generator."
                )
        return original_validate(*bound.args, **bound.kwargs)

    @functools.wraps(original_get)
    def _get_candidate_generator(self, *args, **kwargs):
        bound = get_signature.bind(self, *args, **kwargs)
        drafter = bound.arguments.get("assistant_model")
        generation_config = bound.arguments["generation_config"]
        if _is_angelspec_drafter(drafter) and generation_config.speculation_type != "dflash":
            return drafter.get_candidate_generator(
                target=self,
                input_ids=bound.arguments["input_ids"],
                generation_config=generation_config,
                logits_processor=bound.arguments.get("logits_processor"),
            )
        return original_get(*bound.args, **bound.kwargs)

    _validate_generation_mode._angelspec_original = original_validate
    _get_candidate_generator._angelspec_original = original_get
    GenerationMixin._validate_generation_mode = _validate_generation_mode
    GenerationMixin._get_candidate_generator = _get_candidate_generator
