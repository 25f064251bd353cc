"""`DrafterTrainingArguments`: every drafter hyper-parameter as a validated `TrainingArguments` field."""

from __future__ import annotations

from dataclasses import dataclass, field

from transformers import TrainingArguments

from .data import TRAIN_SETS
from .losses import LOSS_KINDS
from .schedule import SCHEDULES

DRAFTER_TYPES = ("mtp", "dflash", "dfly")
RECIPES = {"mtp": ("sharegpt", "alpaca"), "dflash": ("gsm8k", "code_alpaca", "gpteacher_codegen"),
           "dfly": ("gsm8k", "code_alpaca", "gpteacher_codegen")}


@dataclass
class DrafterTrainingArguments(TrainingArguments):
    drafter_type: str = field(default="dfly", metadata={"help": f"Drafter family: one of {DRAFTER_TYPES}."})
    block_size: int = field(default=8, metadata={"help": "DFlash/DFly: tokens per block (anchor + block_size-1 masks)."})
    num_anchors: int = field(
        default=16, metadata={"help": "DFlash/DFly: blocks sampled per training sequence (one target forward serves "
                                      "them all; every position before a supervised token is eligible)."}
    )
    resample_anchors: bool = field(
        default=True, metadata={"help": "DFlash/DFly: draw the anchors afresh at every step (seeded by seed, step and "
                                        "example, so a resumed run draws the same ones); False: the same anchors "
                                        "for an example every epoch."}
    )
    loss_kind: str = field(
        default="ce", metadata={"help": f"Token loss, one of {LOSS_KINDS}: hard-label cross-entropy on the target's "
                                        "regenerated tokens, KL to the target's own logits (distillation), or both."}
    )
    train_vocab: str = field(
        default="draft", metadata={"help": "'draft': a drafter with a pruned draft vocabulary is trained over exactly "
                                           "those ids (what it drafts over; targets outside it carry no hard label, "
                                           "the target's distribution is renormalised over it); 'full': over all."}
    )
    loss_decay_gamma: float = field(
        default=4.0, metadata={"help": "DFlash/DFly: block row k is weighted exp(-(k-1)/gamma)."}
    )
    mtp_num_steps: int = field(default=4, metadata={"help": "MTP: unrolled prediction steps (= draft tokens)."})
    mtp_step_weights: list[float] | None = field(
        default=None, metadata={"help": "MTP: loss weight of each step; default 0.8**j for step j (0-based)."}
    )
    target_layer_ids: list[int] | None = field(
        default=None, metadata={"help": "Target layers the drafter reads (0-based); default: the family's choice."}
    )
    num_drafter_layers: int | None = field(default=None, metadata={"help": "Drafter depth; default: the family's. With "
                                                                        "init_drafter (DFlash, DFly): grow that drafter to this many layers, the new ones "
                                                                        "starting as identities."})
    ar_head_intermediate_size: int | None = field(
        default=None, metadata={"help": "DFly: the AR head's inner width; default: the family's (the hidden size). "
                                        "With init_drafter: widen that drafter's head to it, the new units starting "
                                        "at zero."}
    )
    feature_mode: str = field(
        default="online", metadata={"help": "'online': target features computed per batch (no disk); 'filling': "
                                            "computed online the first time a sequence is read and stored in "
                                            "feature_cache_dir, read from there after (no pass before training; "
                                            "the next epochs skip the target); 'cached': computed in one pass "
                                            "before training, stored as fp16 Arrow and memory-mapped."}
    )
    feature_cache_dir: str | None = field(default=None, metadata={"help": "Where 'filling' or 'cached' features go."})
    dataset_seed: int | None = field(
        default=None, metadata={"help": "Shuffles the regenerated files before max_train_samples cuts them and numbers "
                                        "the examples (default: seed). Cached features belong to one such order: "
                                        "runs with different seeds share one cache by fixing this (the batches and "
                                        "anchors still follow seed)."}
    )
    train_sets: list[str] | None = field(
        default=None, metadata={"help": f"TRAIN sets to mix (of {sorted(TRAIN_SETS)}); default: the family's recipe."}
    )
    regenerated_dir: str = field(
        default="data/regenerated/smollm2-135m-instruct",
        metadata={"help": "Folder of `<set>.jsonl.gz` (or plain `<set>.jsonl`) target-regenerated responses "
                          "(`angelspec regenerate`)."},
    )
    lookup_corpus: bool = field(
        default=True, metadata={"help": "Write lookup_corpus.safetensors beside the drafter: the regenerated responses "
                                        "of train_sets as token ids, which the generate() hook and the batched "
                                        "engine look up in (corpus lookups) once the drafter is loaded; pushed with "
                                        "it, so anyone who can read the drafter can decode them: turn it off for "
                                        "replies that must stay private."}
    )
    max_seq_length: int = field(default=768, metadata={"help": "Training sequences are cut to this many tokens."})
    max_train_samples: int | None = field(default=None, metadata={"help": "Use at most this many training samples."})
    eval_prompts: int = field(
        default=0, metadata={"help": "Acceptance eval: this many EVAL prompts per set, τ measured with generate()."}
    )
    eval_max_new_tokens: int = field(default=64, metadata={"help": "Acceptance eval: tokens generated per prompt."})
    target_states_dtype: str | None = field(
        default=None, metadata={"help": "Dtype of the frozen target's training forward (its states at the drafter's "
                                        "layers and the teacher's logits), e.g. 'bfloat16': a copy of the target in "
                                        "that dtype computes them (training signal only; the τ eval and any "
                                        "verification use the target as loaded). Default: the target's own dtype."}
    )
    compile_target_states: bool = field(
        default=False, metadata={"help": "torch.compile the decoder layers of the target copy that computes the "
                                         "training states (dynamic shapes; a one-off compile of about a minute on "
                                         "CPU, then its norms, rotary and activations run fused). The target that "
                                         "the τ eval and verification use is never compiled."}
    )
    block_sparse_attention: bool = field(
        default=False, metadata={"help": "DFlash/DFly training steps: attention computes only the scores the block "
                                         "mask keeps (each block's context and its own rows, `trainer/block_attention"
                                         ".py`) instead of dense SDPA over every packed block; the same result to "
                                         "rounding. On CPU it pays in eager runs (a drafter step 0.85x as long) and "
                                         "not under --compile_drafter, so the CPU defaults leave it off."}
    )
    compile_drafter: bool = field(
        default=False, metadata={"help": "torch.compile the drafter's training forward (dynamic shapes; DFlash and "
                                         "DFly: the LM head with the loss too): a one-off compile at the start of "
                                         "each run, then their element-wise work runs fused. Training steps only: "
                                         "the τ eval and inference run the drafter as written."}
    )
    eval_prompts_from: str = field(
        default="eval", metadata={"help": "Acceptance eval prompts: 'eval' (the drafter's EVAL sets) or 'held_out' "
                                          "(prompts of its TRAIN sets whose responses were never regenerated, so never "
                                          "trained on; the prompts scripts/tau_by_training.py measures)."}
    )
    max_train_seconds: float | None = field(
        default=None, metadata={"help": "Stop once this many seconds of training steps have passed (the drafter, its "
                                        "state and card are then saved as at max_steps; max_steps still shapes the "
                                        "learning-rate schedule). For runs with a hard time limit."}
    )
    fit_schedule_to_time: bool = field(
        default=False, metadata={"help": "With max_train_seconds: time the warm-up steps, then make the learning-rate "
                                         "schedule (cosine or linear, after warmup_steps >= 4) end at the step that "
                                         "fits in the time left, and stop there; max_steps is then an upper bound. "
                                         "The fitted length is kept in trainer_state.json (FittedSchedule); a run "
                                         "with --max_steps set to it trains on the same rates."}
    )
    stop_at_step: int | None = field(
        default=None, metadata={"help": "Stop after this optimiser step (the drafter, its state and card are then "
                                        "saved as at max_steps, which still shapes the learning-rate schedule): a "
                                        "run that matches another run's steps on the same schedule."}
    )

    def __post_init__(self):
        if self.drafter_type not in DRAFTER_TYPES:
            raise ValueError(f"drafter_type must be one of {DRAFTER_TYPES}, got {self.drafter_type!r}")
        if self.block_size < 2:
            raise ValueError(f"block_size must be >= 2, got {self.block_size}")
        if self.num_anchors < 1:
            raise ValueError(f"num_anchors must be >= 1, got {self.num_anchors}")
        if self.loss_decay_gamma <= 0:
            raise ValueError(f"loss_decay_gamma must be positive, got {self.loss_decay_gamma}")
        if self.max_train_seconds is not None and self.max_train_seconds <= 0:
            raise ValueError(f"max_train_seconds must be positive, got {self.max_train_seconds}")
        if self.fit_schedule_to_time:
            if not self.max_train_seconds:
                raise ValueError("fit_schedule_to_time needs max_train_seconds: the budget the schedule is fitted to")
            if getattr(self.lr_scheduler_type, "value", self.lr_scheduler_type) not in SCHEDULES:
                raise ValueError(f"fit_schedule_to_time: lr_scheduler_type must be one of {SCHEDULES}, "
                                 f"got {self.lr_scheduler_type}")
            if self.warmup_steps < 4 or self.warmup_steps != int(self.warmup_steps):
                raise ValueError(f"fit_schedule_to_time times the warm-up: warmup_steps must be a step count >= 4, "
                                 f"got {self.warmup_steps}")
        if self.stop_at_step is not None and self.stop_at_step < 1:
            raise ValueError(f"stop_at_step must be >= 1, got {self.stop_at_step}")
        if self.mtp_num_steps < 1:
            raise ValueError(f"mtp_num_steps must be >= 1, got {self.mtp_num_steps}")
        if self.mtp_step_weights is None:
            self.mtp_step_weights = [0.8**j for j in range(self.mtp_num_steps)]
        if len(self.mtp_step_weights) != self.mtp_num_steps or min(self.mtp_step_weights) < 0:
            raise ValueError(
                f"mtp_step_weights needs {self.mtp_num_steps} non-negative weights, got {self.mtp_step_weights}"
            )
        if self.loss_kind not in LOSS_KINDS:
            raise ValueError(f"loss_kind must be one of {LOSS_KINDS}, got {self.loss_kind!r}")
        if self.train_vocab not in ("draft", "full"):
            raise ValueError(f"train_vocab must be 'draft' or 'full', got {self.train_vocab!r}")
        if self.feature_mode not in ("online", "filling", "cached"):
            raise ValueError(f"feature_mode must be 'online', 'filling' or 'cached', got {self.feature_mode!r}")
        if self.feature_mode in ("filling", "cached") and not self.feature_cache_dir:
            raise ValueError(f"feature_mode={self.feature_mode!r} needs feature_cache_dir")
        if self.target_states_dtype not in (None, "float32", "bfloat16", "float16"):
            raise ValueError("target_states_dtype must be float32, bfloat16 or float16, got "
                             f"{self.target_states_dtype!r}")
        if self.eval_prompts_from not in ("eval", "held_out"):
            raise ValueError(f"eval_prompts_from must be 'eval' or 'held_out', got {self.eval_prompts_from!r}")
        if self.train_sets is None:
            self.train_sets = list(RECIPES[self.drafter_type])
        unknown = set(self.train_sets) - set(TRAIN_SETS)
        if unknown:
            raise ValueError(f"unknown train_sets {sorted(unknown)}; choose from {sorted(TRAIN_SETS)}")
        self.remove_unused_columns = False  # the collator's columns are all used by compute_loss
        if self.ddp_find_unused_parameters is None:
            self.ddp_find_unused_parameters = False  # every drafter parameter takes part in every loss
        super().__post_init__()
