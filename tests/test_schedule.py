"""A learning-rate schedule fitted to a time budget (`--fit_schedule_to_time`, `trainer/schedule.py`)."""

import pytest
import torch
from transformers import TrainerControl, TrainerState, get_scheduler

from angelspec_hf.trainer import DrafterTrainingArguments
from angelspec_hf.trainer.schedule import FittedSchedule, evals_between, fit_steps, schedule_factor


@pytest.mark.parametrize("kind", ["cosine", "linear"])
@pytest.mark.parametrize("warmup,total", [(5, 50), (20, 21), (4, 333)])
def test_schedule_factor_is_transformers_step_schedule(kind, warmup, total):
    """Every step's rate equals transformers' `get_scheduler` of that length: a run given `--max_steps` = the fitted
    length trains on the same rates (how DFlash matches DFly's GPU period)."""
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    reference = get_scheduler(kind, optimizer, num_warmup_steps=warmup, num_training_steps=total)
    for step in range(total + 3):
        assert schedule_factor(step, warmup, total, kind) == reference.get_last_lr()[0], step
        optimizer.step()
        reference.step()
    assert schedule_factor(total, warmup, total, kind) == 0.0  # decayed to zero where the fitted run stops
    with pytest.raises(ValueError, match="cosine"):
        schedule_factor(30, 5, 50, "constant")


def test_fit_steps_plans_the_steps_and_evals_that_fit():
    assert evals_between(0, 200, 200) == 1 and evals_between(200, 399, 200) == 0 and evals_between(5, 9, None) == 0
    assert fit_steps(20, 1.0, 100.0, 0.0, None, 10_000) == 20 + 95  # 95% of what is left
    # an eval of 10 s every 20 steps (86 steps would need 66 s and the same 3 evals: 96 s)
    assert fit_steps(20, 1.0, 100.0, 10.0, 20, 10_000) == 85  # 65 s of steps + evals at 40, 60, 80: 95 s
    assert fit_steps(20, 1.0, 100.0, 0.0, None, 60) == 60  # max_steps is the upper bound
    assert fit_steps(20, 5.0, 1.0, 0.0, None, 600) == 21  # no time left: the next step ends it


def test_fitted_schedule_times_the_warm_up_then_stops_at_the_fitted_step():
    """From the steps' times (a fake clock: the first step carries a 30 s eval at start and is not timed), the
    schedule ends at the step that fits in 95% of the budget left after warm-up; training stops there with a
    checkpoint; a resumed run takes the length from the checkpoint instead of fitting again."""
    now = [0.0]
    fitted = FittedSchedule(200.0, warmup=4, clock=lambda: now[0])
    state, control = TrainerState(max_steps=100_000), TrainerControl()
    fitted.on_train_begin(None, state, control)
    for step, seconds in enumerate([30.0, 1.0, 1.5, 1.0], start=1):  # warm-up: median of the last timed is 1.25
        now[0] += seconds
        state.global_step = step
        assert not fitted.on_step_end(None, state, control).should_training_stop
    assert fitted.step_seconds == 1.25 and fitted.steps == 4 + int(0.95 * (200.0 - 33.5) // 1.25)
    for step in range(5, fitted.steps):
        now[0] += 1.25
        state.global_step = step
        assert not fitted.on_step_end(None, state, control).should_training_stop
    state.global_step = fitted.steps
    assert fitted.on_step_end(None, state, control).should_training_stop and control.should_save
    assert now[0] + 1.25 < 200.0  # it stops before the time limit would
    state.stateful_callbacks = {"FittedSchedule": fitted.state()}
    resumed = FittedSchedule(200.0, warmup=4, clock=lambda: now[0])
    state.global_step = 50
    resumed.on_train_begin(None, state, TrainerControl())
    assert resumed.steps == fitted.steps and resumed.step_seconds == 1.25


@pytest.mark.parametrize("kwargs,message", [
    ({}, "needs max_train_seconds"),
    ({"max_train_seconds": 60, "lr_scheduler_type": "constant", "warmup_steps": 20}, "cosine"),
    ({"max_train_seconds": 60, "lr_scheduler_type": "cosine", "warmup_steps": 2}, ">= 4"),
    ({"max_train_seconds": 60, "lr_scheduler_type": "cosine", "warmup_steps": 0.1}, ">= 4"),
])
def test_fitted_schedule_arguments_are_checked(kwargs, message):
    with pytest.raises(ValueError, match=message):
        DrafterTrainingArguments(output_dir="unused", fit_schedule_to_time=True, **kwargs)
