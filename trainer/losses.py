"""Drafter losses as pure functions (the Trainer only wires them). All return a *sum* divided by `num_items`, the
number of supervised (assistant) tokens in the whole optimisation step, so that splitting a batch into micro-batches
under gradient accumulation gives the same gradient as the whole batch."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def sample_anchors(
    supervised: torch.Tensor, num_anchors: int, generator: torch.Generator | None = None
) -> tuple[torch.LongTensor, torch.BoolTensor]:
    """Anchor positions `[num_anchors]` for one sequence and which of them are real.

    `supervised` `[T]` marks tokens that carry a loss (assistant tokens). An anchor `a` is the last verified token of
    a block, so it needs a supervised token right after it (`supervised[a + 1]`) and some context before it
    (`a >= 1`). Anchors are drawn without replacement; when fewer positions qualify, the rest are padding (False).
    """
    candidates = torch.nonzero(supervised[2:], as_tuple=False).flatten() + 1  # a >= 1 with supervised[a + 1]
    order = torch.randperm(candidates.numel(), generator=generator, device="cpu").to(candidates.device)
    chosen = candidates[order[:num_anchors]].sort().values
    valid = torch.ones(num_anchors, dtype=torch.bool, device=supervised.device)
    if chosen.numel() < num_anchors:
        valid[chosen.numel():] = False
        chosen = torch.cat([chosen, chosen.new_zeros(num_anchors - chosen.numel())])
    return chosen, valid


LOSS_KINDS = ("ce", "kl", "ce+kl")


def weighted_cross_entropy(logits: torch.Tensor, labels: torch.LongTensor, weights: torch.Tensor, num_items):
    """`Σ_i weights_i · CE(logits_i, labels_i) / num_items` over supervised rows: logits `[M, V]`, labels `[M]`
    (`-100`: no hard label for that row, e.g. a token outside a pruned training vocabulary)."""
    ce = F.cross_entropy(logits.float(), labels, reduction="none", ignore_index=-100)
    return (ce * weights).sum() / _as_count(num_items, ce)


def weighted_distillation(logits, teacher_logits, weights, num_items) -> torch.Tensor:
    """`Σ_i weights_i · KL(softmax(teacher_i) || softmax(logits_i)) / num_items`: the drafter matches the target's
    whole next-token distribution (what rejection sampling accepts against), not only its argmax."""
    teacher = F.log_softmax(teacher_logits.float(), dim=-1)
    student = F.log_softmax(logits.float(), dim=-1)
    kl = (teacher.exp() * (teacher - student)).sum(-1)
    return (kl * weights).sum() / _as_count(num_items, kl)


def token_loss(logits, labels, weights, num_items, teacher_logits=None, kind: str = "ce") -> torch.Tensor:
    """The per-token objective `kind` (`LOSS_KINDS`): hard-label cross-entropy, distillation from the target's logits
    (`teacher_logits`, same rows and columns as `logits`), or their sum."""
    if kind not in LOSS_KINDS:
        raise ValueError(f"loss kind must be one of {LOSS_KINDS}, got {kind!r}")
    if "kl" in kind and teacher_logits is None:
        raise ValueError(f"loss kind {kind!r} needs the target's logits")
    if kind == "ce":
        return weighted_cross_entropy(logits, labels, weights, num_items)
    if kind == "kl":
        return weighted_distillation(logits, teacher_logits, weights, num_items)
    # both terms from one student log-softmax (on a [M, V] head output it is the loss's largest cost after the head)
    student = F.log_softmax(logits.float(), dim=-1)
    ce = F.nll_loss(student, labels, reduction="none", ignore_index=-100)
    teacher = F.log_softmax(teacher_logits.float(), dim=-1)
    kl = (teacher.exp() * (teacher - student)).sum(-1)
    return ((ce + kl) * weights).sum() / _as_count(num_items, ce)


def block_diffusion_loss(logits, labels, rows: torch.LongTensor, gamma: float, num_items, teacher_logits=None,
                         kind: str = "ce") -> torch.Tensor:
    """DFlash / DFly: the token loss of supervised block rows, row k (1-based, `rows` `[M]`) weighted
    `exp(-(k - 1) / gamma)`: the first drafted token matters most, since a miss ends the accepted run."""
    if gamma <= 0:
        raise ValueError(f"gamma must be positive, got {gamma}")
    weights = torch.exp(-(rows.float() - 1) / gamma)
    return token_loss(logits, labels, weights, num_items, teacher_logits, kind)


def mtp_unrolled_loss(logits, labels, steps: torch.LongTensor, step_weights, num_items, teacher_logits=None,
                      kind: str = "ce") -> torch.Tensor:
    """MTP: the token loss of supervised predictions, step j (0-based, `steps` `[M]`) weighted `step_weights[j]`;
    steps after the first were computed from the drafter's own earlier outputs (unrolled, as in drafting)."""
    weights = torch.as_tensor(step_weights, dtype=torch.float32, device=logits.device)[steps]
    return token_loss(logits, labels, weights, num_items, teacher_logits, kind)


def _as_count(num_items, like: torch.Tensor) -> torch.Tensor:
    if num_items is None:
        raise ValueError("num_items (supervised tokens in the optimisation step) is required")
    return torch.as_tensor(num_items, dtype=torch.float32, device=like.device).clamp_min(1.0)
