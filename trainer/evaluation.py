"""Acceptance: the real mean accepted length τ of a drafter, measured with `target.generate(assistant_model=...)` on
EVAL prompts, and a `TrainerCallback` that logs it during training like any metric (TensorBoard via `report_to`)."""

from __future__ import annotations

import time
from contextlib import contextmanager

import torch
from transformers import TrainerCallback

from angelspec_hf.prompts import chat_input_ids, load_eval_prompts

DOMAIN_EVAL_SETS = {"mtp": ("mt_bench",), "dflash": ("humaneval", "gsm8k"), "dfly": ("humaneval", "gsm8k")}
HELD_OUT_SETS = {"mtp": ("sharegpt", "alpaca"), "dflash": ("gsm8k", "gpteacher_codegen"),
                 "dfly": ("gsm8k", "gpteacher_codegen")}


def held_out_prompts(sets, count: int, regenerated_dir) -> list[str]:
    """`count` prompts, in equal parts from the TRAIN `sets`, whose responses are not in `regenerated_dir` (so no
    drafter trained on them): the last ones of each set's fixed order that were never regenerated."""
    from pathlib import Path

    from .data import load_train_prompts
    from .regenerated_files import read_records

    seen = {rec["id"] for f in Path(regenerated_dir).glob("*.jsonl*") for rec in read_records(f)}
    per_set = -(-count // len(sets))
    prompts = []
    for name in sets:
        prompts += [p["prompt"] for p in load_train_prompts(name) if p["id"] not in seen][-per_set:]
    return prompts[:count]


@contextmanager
def whole_blocks(drafter):
    """Draft every round's whole block (no cost-aware length, no confidence cut, no n-gram lookup rounds): acceptance
    measured this way is the drafter's own, not the serving policy's."""
    keys = ("draft_length", "draft_stop_threshold", "lookup_tokens")
    saved = {key: getattr(drafter.config, key, None) for key in keys}
    drafter.config.draft_length, drafter.config.draft_stop_threshold, drafter.config.lookup_tokens = "full", 0.0, 0
    try:
        yield drafter
    finally:
        for key, value in saved.items():
            setattr(drafter.config, key, value)


@contextmanager
def own_forward(drafter):
    """Run the drafter's own `forward`, in its own dtype. Under mixed precision (`--bf16`) accelerate's `prepare` replaces
    a trained model's `forward` with one wrapped in bf16 autocast (keeping the original as `_original_forward`), so a
    τ measured during such a run would draft in bf16 while inference drafts in the drafter's dtype; inside this
    context the original is back, and the wrapper returns after."""
    patched = drafter.__dict__.get("forward")
    original = getattr(drafter, "_original_forward", None)
    if patched is None or original is None:
        yield drafter
        return
    drafter.forward = original
    try:
        yield drafter
    finally:
        drafter.forward = patched


@torch.no_grad()
def measure_acceptance(target, drafter, tokenizer, prompts: list[str], max_new_tokens: int = 64) -> dict:
    """Greedy (temperature 0) τ over `prompts`, whole blocks drafted: tokens per target forward, bonus token included,
    pooled over rounds; `first` is the share of rounds whose first draft token was accepted. The drafter runs as at
    inference: its own forward in its own dtype, even mid-training under `--bf16` (`own_forward`). `per_prompt` holds
    each prompt's `[accepted draft tokens, rounds, rounds whose first draft token was accepted]`, for paired
    comparisons of two drafters on the same prompts (`paired_tau_ratio`)."""
    was_training = drafter.training
    drafter.eval()
    per_prompt = []
    with whole_blocks(drafter), own_forward(drafter):
        for prompt in prompts:
            ids = chat_input_ids(tokenizer, prompt).to(target.device)
            target.generate(ids, assistant_model=drafter, max_new_tokens=max_new_tokens, do_sample=False)
            stats = drafter.last_speculation_stats
            per_prompt.append([int(sum(stats.accepted)), int(stats.rounds), int(sum(a >= 1 for a in stats.accepted))])
    drafter.train(was_training)
    accepted, rounds, first = (sum(column) for column in zip(*per_prompt)) if per_prompt else (0, 0, 0)
    return {"tau": (accepted + rounds) / max(rounds, 1), "first": first / max(rounds, 1), "rounds": rounds,
            "prompts": len(prompts), "per_prompt": per_prompt}


def paired_tau_ratio(base: list, other: list, resamples: int = 4000, seed: int = 0) -> dict:
    """τ(other) / τ(base) on the same prompts (each a `measure_acceptance` `per_prompt` list), with a 95% interval
    from a paired bootstrap over prompts: prompts are drawn with replacement and both drafters' τ pooled over the same
    draw, so the prompts' own difficulty cancels. A drafter "wins" only where the interval's low end is above 1."""
    import numpy as np

    from angelspec_hf.bench import paired_ratio_interval

    base, other = np.asarray(base, dtype=np.float64), np.asarray(other, dtype=np.float64)
    if base.shape != other.shape or base.ndim != 2 or base.shape[1] != 3 or len(base) == 0:
        raise ValueError("paired_tau_ratio needs per-prompt counts [accepted, rounds, first] of the same prompts for "
                         "both drafters")
    if not (base[:, 1] > 0).all() or not (other[:, 1] > 0).all():
        raise ValueError("paired_tau_ratio needs at least one verification round per prompt for both drafters")

    # τ = (accepted + rounds) / rounds, pooled: per prompt [its τ's numerator, rounds] for each drafter
    pairs = np.stack([other[:, 0] + other[:, 1], other[:, 1], base[:, 0] + base[:, 1], base[:, 1]], axis=1)
    n, d, n0, d0 = pairs.sum(0)
    low, high = paired_ratio_interval(pairs, 0.95, resamples, seed)
    return {"ratio": float((n / d) / (n0 / d0)), "low": low, "high": high, "resamples": resamples}


class AcceptanceEvalCallback(TrainerCallback):
    """Every `eval_steps` (and at the end) logs `tau/<set>` for the drafter's EVAL sets (first `num_prompts`), or with
    `held_out`, `tau/held_out` (and `first/held_out`) over `num_prompts` held-out TRAIN prompts of its domain
    (`held_out_prompts`, read from `regenerated_dir`), then also before the first step of a run that starts afresh."""

    def __init__(self, trainer, tokenizer, num_prompts: int, max_new_tokens: int = 64, sets=None,
                 held_out: bool = False, regenerated_dir=None):
        self.trainer, self.tokenizer = trainer, tokenizer
        self.max_new_tokens = max_new_tokens
        self.at_start = held_out
        if held_out:
            sets = sets or HELD_OUT_SETS[trainer.args.drafter_type]
            self.prompts = {"held_out": held_out_prompts(sets, num_prompts, regenerated_dir)}
        else:
            sets = sets or DOMAIN_EVAL_SETS[trainer.args.drafter_type]
            self.prompts = {name: load_eval_prompts(name, num_prompts) for name in sets}
        self.last, self.last_step = {}, None
        self.seconds = 0.0  # how long the last eval took (what a schedule fitted to a time budget plans for)

    def _evaluate(self, state):
        self.last_step = state.global_step
        if not state.is_world_process_zero:
            return
        started = time.monotonic()
        drafter = self.trainer.accelerator.unwrap_model(self.trainer.model)
        self.last = {}
        for name, prompts in self.prompts.items():
            result = measure_acceptance(self.trainer.target, drafter, self.tokenizer, prompts, self.max_new_tokens)
            self.last |= {f"tau/{name}": result["tau"], f"first/{name}": result["first"]}
        due = self.trainer.control.should_log  # logging clears it: the step's loss, when due, is still logged after
        self.trainer.log(dict(self.last))
        self.trainer.control.should_log = due
        self.seconds = time.monotonic() - started

    def on_train_begin(self, args, state, control, **kwargs):
        if self.at_start and state.global_step == 0:  # the starting drafter's τ: the curve's first point
            self._evaluate(state)

    def on_step_end(self, args, state, control, **kwargs):
        if args.eval_steps and state.global_step % int(args.eval_steps) == 0:
            self._evaluate(state)

    def on_train_end(self, args, state, control, **kwargs):
        if self.last_step != state.global_step:
            self._evaluate(state)
