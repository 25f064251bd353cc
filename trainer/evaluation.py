"""Acceptance: the real mean accepted length τ of a drafter, measured with `target.generate(assistant_model=...)` on
EVAL prompts, and a `TrainerCallback` that logs it during training like any metric (TensorBoard via `report_to`)."""

from __future__ import annotations

import torch
from transformers import TrainerCallback

from angelspec_hf.prompts import chat_input_ids, load_eval_prompts

DOMAIN_EVAL_SETS = {"mtp": ("mt_bench",), "dflash": ("humaneval", "gsm8k"), "dfly": ("humaneval", "gsm8k")}


@torch.no_grad()
def measure_acceptance(target, drafter, tokenizer, prompts: list[str], max_new_tokens: int = 64) -> dict:
    """Greedy (temperature 0) τ over `prompts`: tokens per target forward, bonus token included, pooled over rounds."""
    was_training = drafter.training
    drafter.eval()
    accepted = rounds = 0
    for prompt in prompts:
        ids = chat_input_ids(tokenizer, prompt).to(target.device)
        target.generate(ids, assistant_model=drafter, max_new_tokens=max_new_tokens, do_sample=False)
        stats = drafter.last_speculation_stats
        accepted += sum(stats.accepted)
        rounds += stats.rounds
    drafter.train(was_training)
    return {"tau": (accepted + rounds) / max(rounds, 1), "rounds": rounds, "prompts": len(prompts)}


class AcceptanceEvalCallback(TrainerCallback):
    """Every `eval_steps` (and at the end) logs `tau/<set>` for the drafter's EVAL sets (first `num_prompts`)."""

    def __init__(self, trainer, tokenizer, num_prompts: int, max_new_tokens: int = 64, sets=None):
        self.trainer, self.tokenizer = trainer, tokenizer
        self.max_new_tokens = max_new_tokens
        sets = sets or DOMAIN_EVAL_SETS[trainer.args.drafter_type]
        self.prompts = {name: load_eval_prompts(name, num_prompts) for name in sets}
        self.last, self.last_step = {}, None

    def _evaluate(self, state):
        self.last_step = state.global_step
        if not state.is_world_process_zero:
            return
        drafter = self.trainer.accelerator.unwrap_model(self.trainer.model)
        self.last = {
            f"tau/{name}": measure_acceptance(self.trainer.target, drafter, self.tokenizer, prompts,
                                              self.max_new_tokens)["tau"]
            for name, prompts in self.prompts.items()
        }
        self.trainer.log(dict(self.last))

    def on_step_end(self, args, state, control, **kwargs):
        if args.eval_steps and state.global_step % int(args.eval_steps) == 0:
            self._evaluate(state)

    def on_train_end(self, args, state, control, **kwargs):
        if self.last_step != state.global_step:
            self._evaluate(state)
