"""`DrafterTrainer(Trainer)`: trains a drafter against a frozen target. The target is held beside the model (never a
submodule, so never saved or optimised); `compute_loss` builds the drafter's training inputs and calls the pure
losses of `trainer/losses.py`."""

from __future__ import annotations

import contextlib
import copy
import functools
import time

import torch
from torch import nn
from transformers import Trainer, TrainerCallback
from transformers.trainer_callback import ExportableState
from transformers.trainer_pt_utils import LengthGroupedSampler, get_length_grouped_indices

from angelspec_hf.modeling.drafter_utils import additive_mask
from angelspec_hf.policy.costs import clock

from .block_attention import block_training_attention
from .compute_curve import piece_ends
from .features import StatesStore, target_states
from .losses import block_diffusion_loss, mtp_unrolled_loss, sample_anchors
from .model_card import write_model_card
from .schedule import FittedSchedule, schedule_factor


def _gather_rows(values: torch.Tensor, index: torch.LongTensor) -> torch.Tensor:
    """values `[N, T, ...]`, index `[N, ...]` (clamped into range) → values at those positions per row."""
    index = index.clamp(0, values.shape[1] - 1)
    flat = index.reshape(index.shape[0], -1)
    if values.dim() == 2:
        return torch.gather(values, 1, flat).view_as(index)
    gathered = torch.gather(values, 1, flat[..., None].expand(-1, -1, values.shape[-1]))
    return gathered.view(*index.shape, values.shape[-1])


class SeededLengthGroupedSampler(LengthGroupedSampler):
    """`train_sampling_strategy='group_by_length'`: batches of similar lengths (random mega-batches of 50 batches,
    sorted by length inside), drawn from a generator seeded by `seed` and the epoch, so a run resumed mid-epoch reads
    the batches the uninterrupted run reads. (Random batches of the 8.5k code + math sequences cut at 384 tokens are 41%
    padding; grouped, about 1%.)"""

    def __init__(self, batch_size: int, lengths: list[int], seed: int):
        super().__init__(batch_size, lengths=lengths)
        self.seed, self.epoch = seed, 0

    def set_epoch(self, epoch: int):
        self.epoch = epoch

    def __iter__(self):
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
        return iter(get_length_grouped_indices(self.lengths, self.batch_size, generator=generator))


class BlocksSeen(TrainerCallback, ExportableState):
    """Counts the training blocks (anchors with at least one supervised row; for MTP, positions with at least one
    supervised prediction in their unrolled chain) the drafter has been trained on, kept in
    the checkpoint's `trainer_state.json` so a resumed run continues the count. `DrafterTrainer.log` adds it to every
    log entry as `blocks`, with `blocks_per_second` over the last logging interval."""

    def __init__(self, count: int = 0):
        self.count = count

    def state(self) -> dict:
        return {"args": {}, "attributes": {"count": self.count}}

    def on_train_begin(self, args, state, control, **kwargs):
        saved = state.stateful_callbacks.get(type(self).__name__)
        if saved and state.global_step > 0:
            self.count = saved["attributes"]["count"]


def _block_head_loss(lm_head, rows, labels, row_number, gamma, num_items, teacher, kind):
    """The LM head on the supervised block rows `[M, H]`, then `block_diffusion_loss` (one function, so that
    `--compile_drafter` fuses the head's output with the loss's softmaxes)."""
    logits = lm_head(rows.to(lm_head.weight.dtype))
    return block_diffusion_loss(logits, labels, row_number, gamma, num_items, teacher, kind)


class _RowsHead(nn.Module):
    """The target's LM head restricted to the rows of a training vocabulary: logits `[..., len(rows)]`."""

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.weight = weight  # a plain (frozen) tensor, not a parameter

    def forward(self, hidden):
        return nn.functional.linear(hidden, self.weight)


def pack_blocks(input_ids, supervised, attention_mask, example_index, num_anchors, block_size, mask_token_id, seed,
                step=None):
    """Blocks for one DFlash/DFly training forward: for each sequence, `num_anchors` sampled anchors a (seeded by
    the example, and by the training step when `step` is given: fresh anchors every step, the same ones again on
    resume), block `[x_a, MASK, ...]` at positions a..a+B-1 seeing the context tokens before a and its own block
    (non-causal), as in drafting.

    Returns block ids `[N, A*B]`, position ids `[N, T + A*B]`, an additive-mask keep pattern `[N, A*B, T + A*B]`,
    labels `[N, A, B-1]`, predecessors `[N, A*B]` and the valid-row mask `[N, A, B-1]`, where A is the largest number
    of real anchors of any row (at most `num_anchors`): padding anchors past every row's count are dropped, so
    sequences with fewer eligible positions than `num_anchors` cost no drafter work for blocks that carry no loss.
    """
    n, length = input_ids.shape
    device = input_ids.device
    anchors, anchor_ok = [], []
    host_supervised, host_examples = supervised.cpu(), example_index.tolist()  # one copy from the device, not 2 a row
    for row in range(n):
        key = int(seed) * 1_000_003 + int(host_examples[row])
        if step is not None:
            key += (int(step) + 1) * 1_000_000_007
        gen = torch.Generator().manual_seed(key)
        a, ok = sample_anchors(host_supervised[row], num_anchors, gen)
        anchors.append(a)
        anchor_ok.append(ok)
    anchors, anchor_ok = torch.stack(anchors), torch.stack(anchor_ok)  # [N, num_anchors], real anchors first
    num_anchors = max(int(anchor_ok.sum(1).max()), 1)
    anchors, anchor_ok = anchors[:, :num_anchors].to(device), anchor_ok[:, :num_anchors].to(device)  # [N, A]
    offsets = torch.arange(block_size, device=device)
    positions = anchors[..., None] + offsets  # [N, A, B]
    block_ids = torch.full_like(positions, mask_token_id)
    block_ids[..., 0] = _gather_rows(input_ids, anchors)
    labels = _gather_rows(input_ids, positions[..., 1:])
    valid = anchor_ok[..., None] & (positions[..., 1:] < length) & _gather_rows(supervised, positions[..., 1:])
    previous = _gather_rows(input_ids, positions - 1)  # true predecessor of every row (row 0's is unused)
    # keys: the T context tokens, then every block; a block sees context j < a (real tokens) and itself
    ctx = torch.arange(length, device=device)
    sees_ctx = (ctx[None, None, :] < anchors[..., None]) & attention_mask.bool()[:, None, :]  # [N, A, T]
    block_of = torch.arange(num_anchors, device=device).repeat_interleave(block_size)  # [A*B]
    sees_block = block_of[:, None] == block_of[None, :]  # [A*B, A*B]
    keep = torch.cat(
        [sees_ctx.repeat_interleave(block_size, dim=1), sees_block.expand(n, -1, -1)], dim=2
    )  # [N, A*B, T + A*B]
    position_ids = torch.cat([ctx.expand(n, -1), positions.flatten(1)], dim=1)
    return block_ids.flatten(1), position_ids, keep, labels, previous.flatten(1), valid


class DrafterTrainer(Trainer):
    """`Trainer` for AngelSpec drafters. `args` is a `DrafterTrainingArguments`; `target` the frozen target model."""

    def __init__(self, model, args, target, **kwargs):
        super().__init__(model=model, args=args, **kwargs)
        self.target = target.eval().requires_grad_(False).to(self.args.device)
        self.model_accepts_loss_kwargs = True  # compute_loss normalises by num_items_in_batch itself
        self._drafter = self.accelerator.unwrap_model(model)
        if hasattr(self._drafter, "bind_embeddings"):
            self._drafter.bind_embeddings(self.target.get_input_embeddings())
        self._drafter.check_target(self.target)
        self.base_model_id = getattr(self.target.config, "_name_or_path", None) or "unknown"
        self.acceptance, self.training_summary = {}, {}
        self._train_head = self._teacher_head = None
        dtype = getattr(torch, self.args.target_states_dtype) if self.args.target_states_dtype else self.target.dtype
        # the target that computes the training signal: the target itself, or a copy in target_states_dtype
        self.states_target = self.target
        if dtype != self.target.dtype or self.args.compile_target_states:
            self.states_target = copy.deepcopy(self.target).to(dtype).eval().requires_grad_(False)
        if self.args.compile_target_states:
            layers = getattr(self.states_target.base_model, "layers", None)
            if layers is None:
                raise ValueError(f"compile_target_states: {type(self.target).__name__}'s base model has no `layers` "
                                 "to compile; train without it")
            for layer in layers:
                layer.compile(dynamic=True)
        self._states_store = None
        if self.args.feature_mode == "filling":
            self._states_store = StatesStore(self.args.feature_cache_dir, self.states_target,
                                             self._drafter.config.target_layer_ids, final="kl" in self.args.loss_kind)
        self._compiled = None  # (model, its compiled call) with --compile_drafter
        self._block_head_loss = _block_head_loss
        if self.args.compile_drafter:
            self._block_head_loss = torch.compile(_block_head_loss, dynamic=True)
        self.blocks_seen = BlocksSeen()
        self.add_callback(self.blocks_seen)
        # blocks the starting drafter had seen (its config's `training_blocks`, which `_save` keeps cumulative)
        self.blocks_before = int(getattr(self._drafter.config, "training_blocks", None) or 0)
        # where the pieces of training before this run ended (`held_out_tau_ends`, which `_save` extends)
        self.ends_before = list(getattr(self._drafter.config, "held_out_tau_ends", None) or [])
        self.eval_settings = {"prompts": self.args.eval_prompts, "max_new_tokens": self.args.eval_max_new_tokens}
        self._last_log = None  # (time, blocks) at the previous log
        self.fitted_schedule = None
        if self.args.fit_schedule_to_time:
            # the clock waits for the device's queued work: on CUDA a step's end is not its kernels' end
            self.fitted_schedule = FittedSchedule(self.args.max_train_seconds, int(self.args.warmup_steps),
                                                  int(self.args.eval_steps or 0) or None,
                                                  clock=functools.partial(clock, self.args.device))
            if self.accelerator.num_processes > 1:
                from accelerate.utils import broadcast_object_list

                self.fitted_schedule.agree = lambda steps: broadcast_object_list([steps], from_process=0)[0]
            self.add_callback(self.fitted_schedule)

    def create_scheduler(self, num_training_steps: int, optimizer=None):
        """transformers' scheduler; with `--fit_schedule_to_time`, the same schedule whose length is the step the
        time budget allows (`trainer/schedule.py`), `max_steps` until the warm-up's steps have been timed."""
        if self.fitted_schedule is None or self.lr_scheduler is not None:
            return super().create_scheduler(num_training_steps, optimizer)
        fitted, warmup = self.fitted_schedule, int(self.args.warmup_steps)
        kind = getattr(self.args.lr_scheduler_type, "value", self.args.lr_scheduler_type)
        schedule_factor(warmup, warmup, num_training_steps, kind)  # an unsupported schedule fails here, not mid-run
        self.lr_scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer or self.optimizer, lambda step: schedule_factor(step, warmup, fitted.steps or num_training_steps,
                                                                      kind))
        self._created_lr_scheduler = True
        return self.lr_scheduler

    def _get_train_sampler(self, train_dataset=None):
        dataset = self.train_dataset if train_dataset is None else train_dataset
        if self.args.train_sampling_strategy != "group_by_length" or dataset is None:
            return super()._get_train_sampler(train_dataset)
        lengths = [len(ids) for ids in dataset["input_ids"]]
        return SeededLengthGroupedSampler(self.args.train_batch_size * self.args.gradient_accumulation_steps, lengths,
                                          self.args.data_seed if self.args.data_seed is not None else self.args.seed)

    def log(self, logs: dict, start_time: float | None = None) -> None:
        """Adds `blocks` (training blocks seen, all processes) and, to the loss logs, `blocks_per_second` since the
        previous one (and with `--feature_mode filling`, this process's sequences read from and written to the
        store so far)."""
        blocks = self.blocks_seen.count * self.accelerator.num_processes
        logs = dict(logs) | {"blocks": blocks}
        now = time.monotonic()
        if "loss" in logs and self._states_store is not None:  # --feature_mode filling: how full the store is
            logs |= {"states_read": self._states_store.read, "states_written": self._states_store.written}
        if "loss" in logs:
            if self._last_log is not None and now > self._last_log[0] and blocks >= self._last_log[1]:
                logs["blocks_per_second"] = round((blocks - self._last_log[1]) / (now - self._last_log[0]), 2)
            self._last_log = (now, blocks)
        super().log(logs, start_time)

    def _training_call(self, model):
        """What a step calls to run the drafter: `model`, or with `--compile_drafter` and in training, `model` compiled
        once (dynamic shapes; accelerate's mixed-precision wrapper is traced with it). The module, its parameters and
        what `save_model` writes are unchanged; evaluation and the τ eval call the drafter as written."""
        if not (self.args.compile_drafter and model.training):
            return model
        if self._compiled is None or self._compiled[0] is not model:
            self._compiled = (model, torch.compile(model, dynamic=True))
        return self._compiled[1]

    def training_head(self):
        """`(head, vocab_index)`: the LM head the loss uses and a map full id → its column (None: all ids). With
        `train_vocab='draft'` and a pruned drafter, only the draft vocabulary's rows: the drafter learns exactly the
        distribution it drafts from (and the LM-head work shrinks by V / V_draft)."""
        if self._train_head is None:
            lm_head = self.target.get_output_embeddings()
            ids = getattr(self._drafter, "draft_vocab_ids", None)
            if self.args.train_vocab == "full" or ids is None:
                self._train_head = (lm_head, None)
            else:
                ids = ids.to(lm_head.weight.device)
                index = torch.full((lm_head.weight.shape[0],), -100, dtype=torch.long, device=ids.device)
                index[ids] = torch.arange(len(ids), device=ids.device)
                # in float32 whatever the target's dtype (a bf16 target on a GPU): the student's logits and the loss
                # stay in float32, as with the float32 target of the CPU recipes (8,192 rows: a few MB)
                self._train_head = (_RowsHead(lm_head.weight.detach()[ids].float()), index)
        return self._train_head

    def teacher_head(self):
        """The LM head that turns the states target's final hidden states into the teacher's logits: the training
        head's rows (the pruned draft vocabulary's only, when training over it) in `target_states_dtype`."""
        if self._teacher_head is None:
            head, _ = self.training_head()
            dtype = next(self.states_target.parameters()).dtype
            self._teacher_head = head if head.weight.dtype == dtype else _RowsHead(head.weight.detach().to(dtype))
        return self._teacher_head

    def _labels_and_teacher(self, labels, final, teacher_rows):
        """Hard labels in the training vocabulary's columns and, for distillation, the target's logits at the rows
        `teacher_rows` `[M, 2]` (sequence, position whose next token is the label), over the training vocabulary,
        computed in `target_states_dtype` and returned as float32."""
        _, index = self.training_head()
        if index is not None:
            labels = index[labels]
        teacher = None
        if "kl" in self.args.loss_kind:
            if final is None:
                raise ValueError("distillation needs the target's final hidden states (cached features lack them: "
                                 "recompute the cache with this loss_kind)")
            hidden, head = final[teacher_rows[:, 0], teacher_rows[:, 1]], self.teacher_head()
            with torch.no_grad(), torch.autocast(hidden.device.type, enabled=False):
                teacher = head(hidden.to(head.weight.dtype)).float()
        return labels, teacher

    def create_model_card(self, **kwargs):
        """The card `push_to_hub` uploads: base model, data, block size and the measured τ per eval set."""
        write_model_card(self.args.output_dir, self._drafter, self.base_model_id, self.args.train_sets,
                         self.acceptance, self.training_summary, log_history=self.state.log_history,
                         blocks_before=self.blocks_before, ends_before=self.ends_before,
                         settings=self.eval_settings)

    def _save(self, output_dir=None, state_dict=None):
        """Saves as `Trainer` does, with the drafter's config recording every training block it has seen
        (`training_blocks`: the starting drafter's and this run's), so a run continued from it plots its held-out τ
        against the whole count, and where each piece of training ended (`held_out_tau_ends`: the starting
        drafter's and this run's last logged held-out τ with its eval settings, `[{"blocks", "tau", "prompts",
        "max_new_tokens"}]`; a checkpoint saved before the run's last eval adds none), which its card's fit runs
        through."""
        blocks = self.blocks_seen.count * self.accelerator.num_processes
        self._drafter.config.training_blocks = self.blocks_before + blocks
        ends = piece_ends(self.state.log_history, self.blocks_before, self.ends_before, settings=self.eval_settings,
                          blocks_now=blocks)
        if ends:
            self._drafter.config.held_out_tau_ends = ends
        super()._save(output_dir, state_dict)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if num_items_in_batch is None:  # evaluation: normalise by this batch's own supervised tokens
            num_items_in_batch = inputs["labels"].ne(-100).sum()
        features, final = inputs.get("features"), inputs.get("final")
        if features is None:  # the frozen target in target_states_dtype (default its own), even under --bf16
            with torch.autocast(inputs["input_ids"].device.type, enabled=False):
                if self._states_store is not None:  # --feature_mode filling
                    features, final = self._states_store.states(self.states_target, inputs["input_ids"],
                                                                inputs["attention_mask"])
                else:
                    features, final = target_states(self.states_target, inputs["input_ids"],
                                                    inputs["attention_mask"], self._drafter.config.target_layer_ids,
                                                    final="kl" in self.args.loss_kind)
        features = features.to(self._drafter.dtype)
        if self.args.drafter_type == "mtp":
            loss = self._mtp_loss(model, inputs, features, final, num_items_in_batch)
        else:
            loss = self._block_loss(model, inputs, features, final, num_items_in_batch)
        if self.args.average_tokens_across_devices and self.accelerator.num_processes > 1:
            loss = loss * self.accelerator.num_processes  # num_items counts all processes; DDP averages gradients
        return (loss, {"loss": loss}) if return_outputs else loss

    def _block_loss(self, model, inputs, features, final, num_items):
        embed, (lm_head, _) = self.target.get_input_embeddings(), self.training_head()
        block = self.args.block_size
        step = self.state.global_step if self.args.resample_anchors and model.training else None
        block_ids, position_ids, keep, labels, previous, valid = pack_blocks(
            inputs["input_ids"], inputs["supervised"], inputs["attention_mask"], inputs["example_index"],
            self.args.num_anchors, block, self._drafter.config.mask_token_id, self.args.seed, step,
        )
        if model.training:
            self.blocks_seen.count += int(valid.any(-1).sum())
        dtype = self._drafter.dtype
        sparse = self.args.block_sparse_attention and model.training
        context = features.shape[1]
        # block-sparse attention takes the context part of the mask (each block sees its own rows, no other block's)
        mask = additive_mask(keep[..., :context] if sparse else keep, dtype)
        with block_training_attention(self._drafter) if sparse else contextlib.nullcontext():
            hidden = self._training_call(model)(
                noise_embeds=embed(block_ids).to(dtype), context_hidden_states=features, position_ids=position_ids,
                attention_mask=mask[:, None], previous_ids=previous,
            ).last_hidden_state
        n, anchors = labels.shape[:2]
        rows = hidden.view(n, anchors, block, -1)[:, :, 1:]  # [N, A, B-1, H]
        row_number = torch.arange(1, block, device=rows.device).expand_as(valid)
        label_pos = position_ids[:, inputs["input_ids"].shape[1]:].view(n, anchors, block)[:, :, 1:]
        sequence = torch.arange(n, device=label_pos.device)[:, None, None].expand_as(label_pos)
        teacher_rows = torch.stack([sequence[valid], label_pos[valid] - 1], dim=-1)  # the target predicts p from p-1
        hard, teacher = self._labels_and_teacher(labels[valid], final, teacher_rows)
        # the LM head runs only on rows that carry a loss: [M, V] rather than [N, A, B-1, V]
        return self._block_head_loss(lm_head, rows[valid], hard, row_number[valid], self.args.loss_decay_gamma,
                                     num_items, teacher, self.args.loss_kind)

    def _mtp_loss(self, model, inputs, features, final, num_items):
        embed, (lm_head, _) = self.target.get_input_embeddings(), self.training_head()
        ids, supervised = inputs["input_ids"], inputs["supervised"]
        steps, length = self.args.mtp_num_steps, ids.shape[1] - 1
        index = torch.arange(length, device=ids.device)
        # step j (0-based) at index t reads x_{t+1+j} and predicts x_{t+2+j}
        step_tokens = torch.stack([_gather_rows(ids, (index + 1 + j).expand(ids.shape[0], -1)) for j in range(steps)], 1)
        hidden = self._training_call(model)(
            context_hidden_states=features[:, :length], inputs_embeds=embed(step_tokens).to(features.dtype)
        ).last_hidden_state  # [N, S, L, H]
        target_pos = index[None, None, :] + 2 + torch.arange(steps, device=ids.device)[None, :, None]  # [1, S, L]
        target_pos = target_pos.expand(ids.shape[0], -1, -1)
        valid = (target_pos < ids.shape[1]) & _gather_rows(supervised, target_pos.flatten(1)).view_as(target_pos)
        if model.training:  # an MTP "block": a position whose chain of S predictions has a supervised one
            self.blocks_seen.count += int(valid.any(1).sum())
        step_of = torch.arange(steps, device=ids.device)[None, :, None].expand_as(valid)
        labels = _gather_rows(ids, target_pos.flatten(1)).view_as(target_pos)
        logits = self._drafter.head(hidden[valid], lm_head)  # [M, V]: supervised predictions only
        sequence = torch.arange(ids.shape[0], device=ids.device)[:, None, None].expand_as(valid)
        teacher_rows = torch.stack([sequence[valid], target_pos[valid] - 1], dim=-1)
        hard, teacher = self._labels_and_teacher(labels[valid], final, teacher_rows)
        return mtp_unrolled_loss(logits, hard, step_of[valid], self.args.mtp_step_weights, num_items, teacher,
                                 self.args.loss_kind)
