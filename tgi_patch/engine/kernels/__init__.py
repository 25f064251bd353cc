"""The engine's hot steps, D-Cut selection, verification (of a ragged batch, and of a greedy batch straight from the
packed logits) and the packed target's attention over the paged KV store: Triton kernels on CUDA
(`triton_kernels.py`), the packed attention on a CPU in fp32 in C++ (`cpu_attention.py`), the torch reference
(`reference.py`) everywhere else, side by side in this folder. Same
signatures, same outputs; this module only dispatches (and never imports triton until a kernel is wanted)."""

from __future__ import annotations

import os

from . import cpu_attention, reference


def _use_triton(tensor, force: str = "ANGELSPEC_FORCE_TRITON") -> bool:
    """Triton on CUDA; on CPU only under Triton's interpreter and when the environment variable `force` is set."""
    if os.environ.get("ANGELSPEC_DISABLE_TRITON") == "1":
        return False
    if not (tensor.is_cuda or os.environ.get("TRITON_INTERPRET") == "1" and os.environ.get(force)):
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


def use_paged_attention_kernel(tensor) -> bool:
    """Whether `paged_attention` runs the Triton kernel for tensors like `tensor` (on CUDA; forced under the
    interpreter).
    `reads_pool_in_place` says whether any kernel reads a pool: this one, or the C++ one on a CPU in fp32."""
    return _use_triton(tensor, force="ANGELSPEC_FORCE_TRITON_ATTENTION")


def reads_pool_in_place(tensor) -> bool:
    """Whether `paged_attention` reads a pool like `tensor` through a kernel rather than gathering it: the Triton
    kernel (`use_paged_attention_kernel`) or, on a CPU in fp32, the C++ one (`cpu_attention.usable`). The engine's
    drafters attend in place (`BatchDrafter.in_place`) exactly then."""
    return use_paged_attention_kernel(tensor) or cpu_attention.usable(tensor, tensor)


def paged_attention(query, key_cache, value_cache, page_table, slots, held, new, starts, scaling, page_size: int,
                    held_host: list[int], new_host: list[int], groups=None, causal: bool = True):
    """Attention of a packed ragged batch through the pool's page table, causal or over whole blocks
    (`reference.paged_attention` states the contract): the Triton kernel on CUDA, the C++ kernel on a CPU in fp32
    (`cpu_attention`), the reference's gather + SDPA elsewhere. Under the interpreter the
    kernel is forced by its own variable, `ANGELSPEC_FORCE_TRITON_ATTENTION=1` (not by `ANGELSPEC_FORCE_TRITON`):
    interpreted, it costs milliseconds per (sequence, KV head) program in every layer, which would slow every
    forced run of the verification kernels through the engine about tenfold."""
    if use_paged_attention_kernel(query):
        from .triton_kernels import paged_attention as impl
    elif cpu_attention.usable(query, key_cache, value_cache):
        impl = cpu_attention.paged_attention
    else:
        impl = reference.paged_attention
    return impl(query, key_cache, value_cache, page_table, slots, held, new, starts, scaling, page_size, held_host,
                new_host, groups, causal)
