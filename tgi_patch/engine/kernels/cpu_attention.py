"""The packed target's attention over the paged KV pool on a CPU, in fp32: `angelspec_hf/csrc/paged_attention.cpp`,
compiled for the machine on first use (about 30 s, then cached in torch's extensions folder; it needs a C++ compiler
and ninja, as the weight-streaming linear kernel does).

It reads each sequence's keys and values in place through the page table, once per (sequence, KV head) for all the
query heads that share them and all the sequence's new tokens, where the reference (`reference.paged_attention`)
copies every group of sequences' keys into a padded tensor and runs SDPA under a mask. Same contract, same outputs to
float32 rounding (`tests/test_paged_attention_kernel.py`). `usable()` says when `kernels.paged_attention` takes it: CPU
tensors, fp32, no gradient, the kernel built, and `ANGELSPEC_CPU_ATTENTION` not set to 0 (which keeps the reference)."""

from __future__ import annotations

import functools
import os
from pathlib import Path

import torch


def _source() -> Path:
    """The kernel's source, beside the weight-streaming kernel's (`angelspec_hf/csrc/`, package data)."""
    from angelspec_hf.cpu_kernels import STREAM_SOURCE

    return STREAM_SOURCE.parent / "paged_attention.cpp"


@functools.cache
def _extension():
    """The compiled module, or the exception that building it raised."""
    import platform

    from angelspec_hf.cpu_kernels import compile_extension

    vector_math = ("-lmvec",) if platform.machine() == "x86_64" and platform.libc_ver()[0] == "glibc" else ()
    return compile_extension("angelspec_paged_attention", _source(), "the CPU paged-attention kernel", vector_math)


def available() -> bool:
    """Whether the kernel is built for this machine (building it the first time)."""
    return not isinstance(_extension(), Exception)


def unavailable_reason() -> str | None:
    """Why the kernel could not be built here (the first line of the error), or None when it was."""
    ext = _extension()
    if not isinstance(ext, Exception):
        return None
    return f"{type(ext).__name__}: {(str(ext).strip().splitlines() or [''])[0]}"


def enabled() -> bool:
    """`ANGELSPEC_CPU_ATTENTION=0` keeps the reference's gather + SDPA on the CPU."""
    return os.environ.get("ANGELSPEC_CPU_ATTENTION", "1") != "0"


def usable(query: torch.Tensor, key_cache: torch.Tensor) -> bool:
    """Does `kernels.paged_attention` run this kernel for these tensors?"""
    return (query.device.type == "cpu" and query.dtype == torch.float32 and key_cache.dtype == torch.float32
            and not query.requires_grad and enabled() and available())


def paged_attention(query, key_cache, value_cache, page_table, slots, held, new, starts, scaling, page_size: int,
                    held_host=None, new_host=None, groups=None, causal: bool = True):
    """`reference.paged_attention`'s contract (`held_host`, `new_host` and `groups` are not needed: the kernel reads
    the device values and the page table)."""
    scale = query.shape[-1] ** -0.5 if scaling is None else float(scaling)
    return _extension().paged_attention(query, key_cache, value_cache, page_table, slots, held, new, starts, scale,
                                        int(page_size), bool(causal))
