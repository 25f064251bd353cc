"""`DrafterTrainer(Trainer)`: trains a drafter against a frozen target. The target is held beside the model (never a
submodule, so never saved or optimised); `compute_loss` builds the drafter's training inputs and calls the pure
losses of `trainer/losses.py`."""

from __future__ import annotations

import torch
from torch import nn
from transformers import Trainer

from angelspec_hf.modeling.drafter_utils import additive_mask

from .features import target_states
from .losses import block_diffusion_loss, mtp_unrolled_loss, sample_anchors
from .model_card import write_model_card


def _gather_rows(values: torch.Tensor, index: torch.LongTensor) -> torch.Tensor:
    """values `[N, T, ...]`, index `[N, ...]` (clamped into range) → values at those positions per row."""
    index = index.clamp(0, values.shape[1] - 1)
    flat = index.reshape(index.shape[0], -1)
    if values.dim() == 2:
        return torch.gather(values, 1, flat).view_as(index)
    gathered = torch.gather(values, 1, flat[..., None].expand(-1, -1, values.shape[-1]))
    return gathered.view(*index.shape, values.shape[-1])


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
    labels `[N, A, B-1]`, predecessors `[N, A*B]` and the valid-row mask `[N, A, B-1]`.
    """
    n, length = input_ids.shape
    device = input_ids.device
    anchors, anchor_ok = [], []
    for row in range(n):
        key = int(seed) * 1_000_003 + int(example_index[row])
        if step is not None:
            key += (int(step) + 1) * 1_000_000_007
        gen = torch.Generator().manual_seed(key)
        a, ok = sample_anchors(supervised[row].cpu(), num_anchors, gen)
        anchors.append(a)
        anchor_ok.append(ok)
    anchors, anchor_ok = torch.stack(anchors).to(device), torch.stack(anchor_ok).to(device)  # [N, A]
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
        self._train_head = None

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
                self._train_head = (_RowsHead(lm_head.weight.detach()[ids]), index)
        return self._train_head

    def _labels_and_teacher(self, labels, final, teacher_rows, head):
        """Hard labels in the training vocabulary's columns and, for distillation, the target's logits at the rows
        `teacher_rows` `[M, 2]` (sequence, position whose next token is the label)."""
        _, index = self.training_head()
        if index is not None:
            labels = index[labels]
        teacher = None
        if "kl" in self.args.loss_kind:
            if final is None:
                raise ValueError("distillation needs the target's final hidden states (cached features lack them: "
                                 "recompute the cache with this loss_kind)")
            hidden = final[teacher_rows[:, 0], teacher_rows[:, 1]]
            with torch.no_grad(), torch.autocast(hidden.device.type, enabled=False):
                teacher = head(hidden.to(head.weight.dtype))
        return labels, teacher

    def create_model_card(self, **kwargs):
        """The card `push_to_hub` uploads: base model, data, block size and the measured τ per eval set."""
        write_model_card(self.args.output_dir, self._drafter, self.base_model_id, self.args.train_sets,
                         self.acceptance, self.training_summary, log_history=self.state.log_history)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if num_items_in_batch is None:  # evaluation: normalise by this batch's own supervised tokens
            num_items_in_batch = inputs["labels"].ne(-100).sum()
        features, final = inputs.get("features"), inputs.get("final")
        if features is None:  # the frozen target in its own precision, as it runs at inference, even under --bf16
            with torch.autocast(inputs["input_ids"].device.type, enabled=False):
                features, final = target_states(self.target, inputs["input_ids"], inputs["attention_mask"],
                                                self._drafter.config.target_layer_ids,
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
        dtype = self._drafter.dtype
        mask = additive_mask(keep, dtype)
        hidden = model(
            noise_embeds=embed(block_ids).to(dtype), context_hidden_states=features, position_ids=position_ids,
            attention_mask=mask[:, None], previous_ids=previous,
        ).last_hidden_state
        n, anchors = labels.shape[:2]
        rows = hidden.view(n, anchors, block, -1)[:, :, 1:]  # [N, A, B-1, H]
        row_number = torch.arange(1, block, device=rows.device).expand_as(valid)
        # the LM head runs only on rows that carry a loss: [M, V] rather than [N, A, B-1, V]
        logits = lm_head(rows[valid].to(lm_head.weight.dtype))
        label_pos = position_ids[:, inputs["input_ids"].shape[1]:].view(n, anchors, block)[:, :, 1:]
        sequence = torch.arange(n, device=label_pos.device)[:, None, None].expand_as(label_pos)
        teacher_rows = torch.stack([sequence[valid], label_pos[valid] - 1], dim=-1)  # the target predicts p from p-1
        hard, teacher = self._labels_and_teacher(labels[valid], final, teacher_rows, lm_head)
        return block_diffusion_loss(logits, hard, row_number[valid], self.args.loss_decay_gamma, num_items, teacher,
                                    self.args.loss_kind)

    def _mtp_loss(self, model, inputs, features, final, num_items):
        embed, (lm_head, _) = self.target.get_input_embeddings(), self.training_head()
        ids, supervised = inputs["input_ids"], inputs["supervised"]
        steps, length = self.args.mtp_num_steps, ids.shape[1] - 1
        index = torch.arange(length, device=ids.device)
        # step j (0-based) at index t reads x_{t+1+j} and predicts x_{t+2+j}
        step_tokens = torch.stack([_gather_rows(ids, (index + 1 + j).expand(ids.shape[0], -1)) for j in range(steps)], 1)
        hidden = model(context_hidden_states=features[:, :length], inputs_embeds=embed(step_tokens).to(features.dtype)
                       ).last_hidden_state  # [N, S, L, H]
        target_pos = index[None, None, :] + 2 + torch.arange(steps, device=ids.device)[None, :, None]  # [1, S, L]
        target_pos = target_pos.expand(ids.shape[0], -1, -1)
        valid = (target_pos < ids.shape[1]) & _gather_rows(supervised, target_pos.flatten(1)).view_as(target_pos)
        step_of = torch.arange(steps, device=ids.device)[None, :, None].expand_as(valid)
        labels = _gather_rows(ids, target_pos.flatten(1)).view_as(target_pos)
        logits = self._drafter.head(hidden[valid], lm_head)  # [M, V]: supervised predictions only
        sequence = torch.arange(ids.shape[0], device=ids.device)[:, None, None].expand_as(valid)
        teacher_rows = torch.stack([sequence[valid], target_pos[valid] - 1], dim=-1)
        hard, teacher = self._labels_and_teacher(labels[valid], final, teacher_rows, lm_head)
        return mtp_unrolled_loss(logits, hard, step_of[valid], self.args.mtp_step_weights, num_items, teacher,
                                 self.args.loss_kind)
