"""The packed target's attention over the paged KV pool on a CPU, in fp32: `angelspec_hf/csrc/paged_attention.cpp`,
compiled for the machine on first use (about 30 s, then cached in torch's extensions folder; it needs a C++ compiler
and ninja, as the weight-streaming linear kernel does).

It reads each sequence's keys and values in place through the page table, once per (sequence, KV head) for all the
query heads that share them and all the sequence's new tokens, where the reference (`reference.paged_attention`)
copies every group of sequences' keys into a padded tensor and runs SDPA under a mask. A sequence adding one token
computes its scores key by key; one adding several (a verification, a drafter's block) computes blocks of query rows
against tiles of keys, as a matrix product does. Same contract, same outputs to
float32 rounding (`tests/test_cpu_paged_attention.py`). `usable()` says when `kernels.paged_attention` takes it: CPU
tensors, fp32, no gradient, the kernel built, and `ANGELSPEC_CPU_ATTENTION` not set to 0 (which keeps the
reference); within a step, a sequence adding more than `MAX_NEW_TOKENS` tokens (a prompt's prefill) attends through
the reference. The engine's drafters attend through it too where it reads their pool (`BatchDrafter.in_place`): a
DFlash / DFly block's rows over the whole context, MTP's new tokens causally."""

from __future__ import annotations

import functools
import os
from pathlib import Path

import torch


def _source() -> Path:
    """The kernel's source, beside the weight-streaming kernel's (`angelspec_hf/csrc/`, package data)."""
    from angelspec_hf.cpu_kernels import STREAM_SOURCE

    return STREAM_SOURCE.parent / "paged_attention.cpp"


def build_flags() -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The extra compile and link flags of the kernel's build: glibc's vector math library on x86-64."""
    import platform

    mvec = platform.machine() == "x86_64" and platform.libc_ver()[0] == "glibc"
    return ("-DANGELSPEC_MVEC",) if mvec else (), ("-lmvec",) if mvec else ()


def build(source: Path | None = None, prefix: str = "angelspec_paged_attention",
          what: str = "the CPU paged-attention kernel"):
    """The compiled module of `source` (default: the kernel's own; another version of it for a benchmark's
    baseline), built with the kernel's flags, or the exception that building it raised."""
    from angelspec_hf.cpu_kernels import compile_extension

    return compile_extension(prefix, source or _source(), what, *build_flags())


@functools.cache
def _extension():
    """The compiled module, or the exception that building it raised."""
    return build()


@functools.cache
def source_version() -> str:
    """A short hash of the kernel's source and build flags: an engine's cost profiles timed with one version of it
    are not reused with another (`ModelRunner.attention_kind`)."""
    import hashlib

    flags = "\n".join(" ".join(group) for group in build_flags()).encode()
    return hashlib.sha256(_source().read_bytes() + flags).hexdigest()[:10]


def available() -> bool:
    """Whether the kernel is built for this machine (building it the first time)."""
    return not isinstance(_extension(), Exception)


def unavailable_reason() -> str | None:
    """Why the kernel could not be built here (the first line of the error), or None when it was."""
    from angelspec_hf.cpu_kernels import build_error

    return build_error(_extension())


def enabled() -> bool:
    """`ANGELSPEC_CPU_ATTENTION=0` keeps the reference's gather + SDPA on the CPU."""
    return os.environ.get("ANGELSPEC_CPU_ATTENTION", "1") != "0"


MAX_NEW_TOKENS = 16  # a sequence adding more this step (a prompt's prefill) attends through the reference


def usable(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor | None = None) -> bool:
    """Does `kernels.paged_attention` run this kernel for these tensors? CPU tensors in fp32, no gradient wanted,
    enabled, and built."""
    tensors = [t for t in (query, key_cache, value_cache) if t is not None]
    return (all(t.device.type == "cpu" and t.dtype == torch.float32 for t in tensors)
            and not (torch.is_grad_enabled() and any(t.requires_grad for t in tensors)) and enabled() and available())


def paged_attention(query, key_cache, value_cache, page_table, slots, held, new, starts, scaling, page_size: int,
                    held_host=None, new_host=None, groups=None, causal: bool = True):
    """`reference.paged_attention`'s contract. The sequences adding more than `MAX_NEW_TOKENS` this step (by
    `new_host`; None: none are split off) attend through the reference, whose blocked products are faster for a
    prompt's prefill; every other sequence through the kernel, which reads the device values and the page table
    (`groups` is not needed)."""
    scale = query.shape[-1] ** -0.5 if scaling is None else float(scaling)
    kernel = _extension().paged_attention
    long_rows = [b for b, n in enumerate(new_host or ()) if n > MAX_NEW_TOKENS]
    if not long_rows:
        return kernel(query, key_cache, value_cache, page_table, slots, held, new, starts, scale, int(page_size),
                      bool(causal))
    from itertools import accumulate

    from . import reference

    rows = torch.tensor(long_rows, device=query.device)
    out = kernel(query, key_cache, value_cache, page_table, slots, held, new.index_fill(0, rows, 0), starts, scale,
                 int(page_size), bool(causal))  # the long sequences' rows are left to the reference
    offsets = list(accumulate([0, *new_host[:-1]]))  # `starts` as the host knows it
    tokens = torch.cat([torch.arange(offsets[b], offsets[b] + new_host[b]) for b in long_rows]).to(query.device)
    sub_new = [new_host[b] for b in long_rows]
    out[tokens] = reference.paged_attention(
        query[tokens], key_cache, value_cache, page_table, slots[rows], held[rows], new[rows],
        torch.tensor(list(accumulate([0, *sub_new[:-1]])), device=query.device), scaling, page_size,
        [held_host[b] for b in long_rows], sub_new, None, causal)
    return out
