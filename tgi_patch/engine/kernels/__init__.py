"""The engine's hot steps, D-Cut selection and verification (of a ragged batch, and of a greedy batch straight from the
packed logits): Triton kernels on CUDA (`triton_kernels.py`), the torch reference (`reference.py`) everywhere else,
side by side in this folder. Same signatures, same outputs; this module only dispatches (and never imports triton
until a kernel is wanted)."""

from __future__ import annotations

import os

from . import reference


def _use_triton(tensor) -> bool:
    if os.environ.get("ANGELSPEC_DISABLE_TRITON") == "1":
        return False
    if not (tensor.is_cuda or os.environ.get("TRITON_INTERPRET") == "1" and os.environ.get("ANGELSPEC_FORCE_TRITON")):
        return False
    try:
        from . import triton_kernels  # noqa: F401
    except ImportError:
        return False
    return True


def dcut_select(accept_prob, num_drafted, budget, step_cost=None, base_gain: float = 0.0):
    if _use_triton(accept_prob):
        from .triton_kernels import dcut_select as impl
    else:
        impl = reference.dcut_select
    return impl(accept_prob, num_drafted, budget, step_cost, base_gain)


def verify(scores, draft, draft_probs, depth, greedy, u_accept, u_sample):
    if _use_triton(scores):
        from .triton_kernels import verify as impl
    else:
        impl = reference.verify
    return impl(scores, draft, draft_probs, depth, greedy, u_accept, u_sample)


def verify_greedy(logits, positions, draft, depth, depth_host=None):
    if draft.shape[1] < positions.shape[1] - 1:
        raise ValueError(f"greedy verification of {positions.shape[1]} positions per row needs at least "
                         f"{positions.shape[1] - 1} draft tokens per row, got draft of shape {tuple(draft.shape)}")
    if _use_triton(logits):
        from .triton_kernels import verify_greedy as impl
    else:
        impl = reference.verify_greedy
    return impl(logits, positions, draft, depth, depth_host)
