"""A learning-rate schedule sized to a time budget (`--fit_schedule_to_time`).

A run stopped by `--max_train_seconds` before `max_steps` ends wherever its schedule happens to be: on a device whose
speed is not known in advance (a borrowed GPU), a cosine over a guessed `max_steps` may stop near its peak, and a
drafter continued at its peak learning rate drafts worse than it started (docs/training.md). `FittedSchedule` times
the warm-up steps, then sets the schedule's length to the steps that fit in what is left of the budget (the τ evals
due on the way included), and stops the run there: the learning rate has decayed to zero when the time is up. The
schedule it gives is exactly transformers' step schedule (`get_scheduler`) of that length, so a run given
`--max_steps N` (N: the fitted length, kept in `trainer_state.json`) trains on the same learning rate at every step:
how the playbook trains DFlash at equal budget with DFly.
"""

from __future__ import annotations

import math
import statistics
import time

from transformers import TrainerCallback
from transformers.trainer_callback import ExportableState

SCHEDULES = ("cosine", "linear")
MARGIN = 0.95  # the share of the remaining budget the fitted steps are planned to take (the time limit still holds)


def schedule_factor(step: int, warmup: int, total: int, kind: str) -> float:
    """The learning-rate multiplier at `step` of transformers' `get_scheduler(kind)` with `warmup` warm-up steps over
    `total` steps (the same formulas, so a step-scheduled run of `total` steps gets the same rates)."""
    if step < warmup:
        return float(step) / float(max(1, warmup))
    if kind == "linear":
        return max(0.0, float(total - step) / float(max(1, total - warmup)))
    if kind == "cosine":
        progress = float(step - warmup) / float(max(1, total - warmup))
        return max(0.0, 0.5 * (1.0 + math.cos(math.pi * progress)))
    raise ValueError(f"fit_schedule_to_time: the schedule must be one of {SCHEDULES}, got {kind!r}")


def evals_between(start: int, end: int, every: int | None) -> int:
    """How many steps in (start, end] are multiples of `every` (the τ evals a run makes on the way)."""
    return (end // every - start // every) if every else 0


def fit_steps(step: int, step_seconds: float, remaining: float, eval_seconds: float, eval_every: int | None,
              max_steps: int) -> int:
    """The last step of a schedule at `step`, with `remaining` seconds of budget, steps of `step_seconds` and an
    eval of `eval_seconds` every `eval_every` steps: the most steps whose time fits in `MARGIN` of what remains,
    between step + 1 and `max_steps`."""
    budget, step_seconds = MARGIN * remaining, max(step_seconds, 1e-9)
    steps = min(step + int(budget // step_seconds), max_steps)
    while steps > step + 1 and (steps - step) * step_seconds + eval_seconds * evals_between(step, steps, eval_every) > budget:
        steps -= 1  # the evals on the way take their share
    return max(step + 1, min(steps, max_steps))


class FittedSchedule(TrainerCallback, ExportableState):
    """Times the steps up to the end of warm-up, then sets `steps` (the schedule's length, `schedule_factor`'s total)
    to what fits in `seconds` from the start of training, and stops training after that step with a checkpoint.
    `steps` is kept in the checkpoint's `trainer_state.json`: a resumed run keeps its schedule. `eval_seconds` (set
    by the trainer's τ eval callback, if any) gives the last eval's duration."""

    def __init__(self, seconds: float, warmup: int, eval_every: int | None = None, clock=time.monotonic):
        self.seconds, self.warmup, self.eval_every, self.clock = seconds, warmup, eval_every, clock
        self.steps: int | None = None  # None until fitted
        self.step_seconds: float | None = None
        self.eval_seconds = lambda: 0.0
        self.agree = lambda steps: steps  # several processes: every one takes the main process's length
        self.start = self.last = None
        self.durations: list[float] = []

    def state(self) -> dict:
        return {"args": {}, "attributes": {"steps": self.steps, "step_seconds": self.step_seconds}}

    def on_train_begin(self, args, state, control, **kwargs):
        self.start = self.last = self.clock()
        saved = state.stateful_callbacks.get(type(self).__name__)
        if saved and state.global_step > 0 and saved["attributes"]["steps"]:
            self.steps, self.step_seconds = saved["attributes"]["steps"], saved["attributes"]["step_seconds"]

    def on_step_end(self, args, state, control, **kwargs):
        now = self.clock()
        self.durations.append(now - self.last)
        self.last = now
        timed = self.durations[1:]  # the first step carries what runs before it (the τ eval at start, warm-ups)
        if self.steps is None and state.global_step >= self.warmup and len(timed) >= 2:
            self.step_seconds = statistics.median(timed[len(timed) // 2:])
            self.steps = self.agree(fit_steps(state.global_step, self.step_seconds, self.seconds - (now - self.start),
                                              self.eval_seconds(), self.eval_every, state.max_steps))
            print(f"fit_schedule_to_time: the schedule ends at step {self.steps} ({self.step_seconds:.3f} s a step, "
                  f"{self.seconds - (now - self.start):.0f} s left at step {state.global_step})", flush=True)
        if self.steps is not None and state.global_step >= self.steps:
            control.should_training_stop = control.should_save = True
        return control
