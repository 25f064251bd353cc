"""`DrafterTrainer(Trainer)`: trains a drafter against a frozen target. The target is held beside the model (never a
submodule, so never saved or optimised); `compute_loss` builds the drafter's training inputs and calls the pure
losses of `trainer/losses.py`."""

from __future__ import annotations

import torch
from transformers import Trainer

from .features import target_features
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


def pack_blocks(input_ids, supervised, attention_mask, example_index, num_anchors, block_size, mask_token_id, seed):
    """Blocks for one DFlash/DFly training forward: for each sequence, `num_anchors` sampled anchors a (seeded by
    the example, so the same example always gets the same anchors), block `[x_a, MASK, ...]` at positions
    a..a+B-1 seeing the context tokens before a and its own block (non-causal), as in drafting.

    Returns block ids `[N, A*B]`, position ids `[N, T + A*B]`, an additive-mask keep pattern `[N, A*B, T + A*B]`,
    labels `[N, A, B-1]`, predecessors `[N, A*B]` and the valid-row mask `[N, A, B-1]`.
    """
    n, length = input_ids.shape
    device = input_ids.device
    anchors, anchor_ok = [], []
    for row in range(n):
        gen = torch.Generator().manual_seed(int(seed) * 1_000_003 + int(example_index[row]))
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

    def create_model_card(self, **kwargs):
        """The card `push_to_hub` uploads: base model, data, block size and the measured τ per eval set."""
        write_model_card(self.args.output_dir, self._drafter, self.base_model_id, self.args.train_sets,
                         self.acceptance, self.training_summary)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if num_items_in_batch is None:  # evaluation: normalise by this batch's own supervised tokens
            num_items_in_batch = inputs["labels"].ne(-100).sum()
        features = inputs.get("features")
        if features is None:
            features = target_features(self.target, inputs["input_ids"], inputs["attention_mask"],
                                       self._drafter.config.target_layer_ids)
        features = features.to(self._drafter.dtype)
        if self.args.drafter_type == "mtp":
            loss = self._mtp_loss(model, inputs, features, num_items_in_batch)
        else:
            loss = self._block_loss(model, inputs, features, num_items_in_batch)
        if self.args.average_tokens_across_devices and self.accelerator.num_processes > 1:
            loss = loss * self.accelerator.num_processes  # num_items counts all processes; DDP averages gradients
        return (loss, {"loss": loss}) if return_outputs else loss

    def _block_loss(self, model, inputs, features, num_items):
        embed, lm_head = self.target.get_input_embeddings(), self.target.get_output_embeddings()
        block = self.args.block_size
        block_ids, position_ids, keep, labels, previous, valid = pack_blocks(
            inputs["input_ids"], inputs["supervised"], inputs["attention_mask"], inputs["example_index"],
            self.args.num_anchors, block, self._drafter.config.mask_token_id, self.args.seed,
        )
        dtype = self._drafter.dtype
        mask = torch.zeros(keep.shape, dtype=dtype, device=keep.device).masked_fill(~keep, torch.finfo(dtype).min)
        hidden = model(
            noise_embeds=embed(block_ids).to(dtype), context_hidden_states=features, position_ids=position_ids,
            attention_mask=mask[:, None], previous_ids=previous,
        ).last_hidden_state
        n, anchors = labels.shape[:2]
        rows = hidden.view(n, anchors, block, -1)[:, :, 1:]  # [N, A, B-1, H]
        row_number = torch.arange(1, block, device=rows.device).expand_as(valid)
        # the LM head runs only on rows that carry a loss: [M, V] rather than [N, A, B-1, V]
        logits = lm_head(rows[valid].to(lm_head.weight.dtype))
        return block_diffusion_loss(logits, labels[valid], row_number[valid], self.args.loss_decay_gamma, num_items)

    def _mtp_loss(self, model, inputs, features, num_items):
        embed, lm_head = self.target.get_input_embeddings(), self.target.get_output_embeddings()
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
        return mtp_unrolled_loss(logits, labels[valid], step_of[valid], self.args.mtp_step_weights, num_items)
