"""Losses against closed forms and hand-computed tiny cases."""

import math

import pytest
import torch

from angelspec_hf.trainer.losses import block_diffusion_loss, mtp_unrolled_loss, sample_anchors, weighted_cross_entropy


def test_weighted_cross_entropy_closed_form():
    logits = torch.tensor([[0.0, 0.0], [math.log(3.0), 0.0]])  # CE: ln 2, and -ln(3/4)
    loss = weighted_cross_entropy(logits, torch.tensor([1, 0]), torch.tensor([2.0, 1.0]), num_items=4)
    assert loss.item() == pytest.approx((2 * math.log(2) - math.log(0.75)) / 4)


def test_block_rows_decay_exponentially():
    # uniform logits over V=5 give CE = ln 5 on every row; rows 1, 2, 3 weigh 1, e^{-1/2}, e^{-1}
    logits = torch.zeros(3, 5)
    loss = block_diffusion_loss(logits, torch.tensor([0, 1, 2]), torch.tensor([1, 2, 3]), gamma=2.0, num_items=3)
    assert loss.item() == pytest.approx(math.log(5) * (1 + math.exp(-0.5) + math.exp(-1.0)) / 3)
    with pytest.raises(ValueError, match="gamma must be positive"):
        block_diffusion_loss(logits, torch.tensor([0, 1, 2]), torch.tensor([1, 2, 3]), gamma=0.0, num_items=3)


def test_mtp_step_weights():
    logits = torch.zeros(4, 7)
    loss = mtp_unrolled_loss(logits, torch.tensor([0, 1, 2, 3]), torch.tensor([0, 0, 1, 2]), [1.0, 0.5, 0.25], 2)
    assert loss.item() == pytest.approx(math.log(7) * (1 + 1 + 0.5 + 0.25) / 2)


def test_normalisation_splits_over_micro_batches():
    """sum over micro-batches of (their sum / global count) == whole batch: gradient accumulation invariance."""
    g = torch.Generator().manual_seed(0)
    logits, labels, rows = torch.randn(10, 6, generator=g), torch.randint(0, 6, (10,), generator=g), torch.randint(1, 8, (10,), generator=g)
    whole = block_diffusion_loss(logits, labels, rows, 4.0, num_items=10)
    parts = sum(block_diffusion_loss(logits[s], labels[s], rows[s], 4.0, num_items=10) for s in (slice(0, 3), slice(3, 10)))
    assert whole.item() == pytest.approx(parts.item())


def test_anchor_sampling_near_the_end():
    supervised = torch.tensor([0, 0, 0, 1, 1, 1, 0, 1])  # supervised tokens at 3, 4, 5, 7
    anchors, valid = sample_anchors(supervised, 6, torch.Generator().manual_seed(0))
    # an anchor needs a supervised token right after it and context before it: a in {2, 3, 4, 6}
    assert sorted(anchors[valid].tolist()) == [2, 3, 4, 6] and valid.sum() == 4
    anchors, valid = sample_anchors(supervised, 2, torch.Generator().manual_seed(1))
    assert valid.all() and set(anchors.tolist()) <= {2, 3, 4, 6} and len(set(anchors.tolist())) == 2
    anchors, valid = sample_anchors(torch.tensor([1, 1, 0, 0]), 3)  # only position 0 precedes a supervised token
    assert not valid.any()


def test_distillation_is_zero_at_the_teacher_and_adds_to_cross_entropy():
    from angelspec_hf.trainer.losses import token_loss, weighted_distillation

    torch.manual_seed(0)
    teacher = torch.randn(5, 11)
    weights = torch.tensor([1.0, 0.5, 0.5, 0.25, 1.0])
    assert float(weighted_distillation(teacher.clone(), teacher, weights, 5)) == pytest.approx(0.0, abs=1e-6)
    student = torch.randn(5, 11)
    kl = weighted_distillation(student, teacher, weights, 5)
    p = teacher.softmax(-1)
    manual = ((p * (p.log() - student.log_softmax(-1))).sum(-1) * weights).sum() / 5
    assert float(kl) == pytest.approx(float(manual), rel=1e-5) and float(kl) > 0
    labels = torch.tensor([1, -100, 3, 4, 5])  # -100: no hard label (outside a pruned training vocabulary)
    ce = token_loss(student, labels, weights, 5, kind="ce")
    both = token_loss(student, labels, weights, 5, teacher, kind="ce+kl")
    assert float(both) == pytest.approx(float(ce) + float(kl), rel=1e-5)
    with pytest.raises(ValueError, match="needs the target's logits"):
        token_loss(student, labels, weights, 5, kind="kl")
