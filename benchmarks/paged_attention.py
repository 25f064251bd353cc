"""The packed target's attention for one layer, as the batched engine runs it: the gather + SDPA path
(`kernels.reference.paged_attention`, each group of sequences' keys/values copied out of the pool into a padded
tensor, then SDPA under an additive mask) against the kernel that reads them through the page table (on CUDA
`kernels.triton_kernels.paged_attention`, on a CPU `kernels.cpu_attention`), on random keys in a paged pool whose
pages are shuffled.

    python benchmarks/paged_attention.py                       # CUDA when available
    python benchmarks/paged_attention.py --device cpu --batch 1,8 --context 256 --new 1,4

Shapes: SmolLM2-135M's 9 query and 3 key/value heads of 64 (`--heads`, `--kv-heads`, `--head-dim`), pages of 16
tokens; every sequence of a batch holds `context` tokens and adds `new` this step (T = batch x new query tokens). Per
shape: milliseconds per call, median of `--repeats` timed calls after a warm-up (on CUDA each timed call is
synchronised; the groups the gather path uses are built once beforehand, as the engine builds them once per step for
all layers), and the largest absolute difference between the two outputs. Without CUDA the kernel timed is the C++
one the engine runs on a CPU in fp32 (`kernels.cpu_attention`); in other dtypes only the gather + SDPA path is
timed."""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from angelspec_hf.tgi_patch.engine.kernels import cpu_attention, reference
from angelspec_hf.tgi_patch.engine.paged import PagedKVPool, RaggedStep


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


def build(batch, context, new, heads, kv_heads, head_dim, dtype, device, seed=0):
    """The arguments of `paged_attention` for `batch` sequences holding `context` tokens, each adding `new`, in a pool
    whose free pages were shuffled (a sequence's pages are scattered, as after many requests came and went), and the
    step (whose `groups` the gather path takes)."""
    g = torch.Generator().manual_seed(seed)
    pages = batch * -(-(context + new) // 16) + 1
    pool = PagedKVPool(1, kv_heads, head_dim, dtype, device, max_seqs=batch, num_pages=pages)
    pool.free_pages = [pool.free_pages[i] for i in torch.randperm(len(pool.free_pages), generator=g)]
    slots_host = list(range(batch))
    pool.reserve(slots_host, [context + new] * batch)
    pool.set_lengths(slots_host, [context] * batch)
    pool.k.normal_(generator=torch.Generator(device).manual_seed(seed))
    pool.v.normal_(generator=torch.Generator(device).manual_seed(seed + 1))
    pool.k[:, : pool.page_size] = 0  # the reserved page stays zero, as in the engine
    pool.v[:, : pool.page_size] = 0
    slots = torch.arange(batch, device=device)
    step = RaggedStep.build(pool, slots, torch.full((batch,), new, device=device), packed=True,
                            slots_host=slots_host, new_host=[new] * batch)
    query = torch.randn(heads, batch * new, head_dim, generator=g).to(device, dtype).transpose(0, 1)  # [T, H, D]
    args = (query, pool.k[0], pool.v[0], pool.page_table, step.slots, step.held, step.new, step.starts(),
            head_dim ** -0.5, pool.page_size, step.held_host, step.new_host)
    return args, step


def timed(fn, repeats: int, cuda: bool) -> float:
    """Median milliseconds of `repeats` calls of `fn` after two untimed ones."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(repeats):
        if cuda:
            torch.cuda.synchronize()
        began = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize()
        times.append((time.perf_counter() - began) * 1e3)
    return statistics.median(times)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default=None, help="float32 | float16 | bfloat16 (default: bf16 on CUDA, fp32 "
                                                      "elsewhere)")
    parser.add_argument("--batch", type=_ints, default=[1, 8, 32, 64], help="comma-separated batch sizes")
    parser.add_argument("--context", type=_ints, default=[256, 1024, 2048], help="tokens held per sequence")
    parser.add_argument("--new", type=_ints, default=[1, 4, 8], help="tokens each sequence adds this step")
    parser.add_argument("--heads", type=int, default=9)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--threads", type=int, default=None, help="CPU threads (default: torch's)")
    parser.add_argument("--baseline-source", type=Path, default=None,
                        help="CPU: another version of angelspec_hf/csrc/paged_attention.cpp (e.g. `git show "
                             "<rev>:angelspec_hf/csrc/paged_attention.cpp > old.cpp`), timed as a third column; "
                             "both compiled modules are then called directly, and max|diff| covers both")
    a = parser.parse_args()
    device = torch.device(a.device)
    cuda = device.type == "cuda"
    if cuda and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is available")
    dtype = getattr(torch, a.dtype) if a.dtype else (torch.bfloat16 if cuda else torch.float32)
    if a.threads:
        torch.set_num_threads(a.threads)
    kernel = None
    if cuda:
        from angelspec_hf.tgi_patch.engine.kernels import triton_kernels  # (needs the `kernels` extra: triton)

        kernel = triton_kernels.paged_attention
        where = torch.cuda.get_device_name(device)
    elif dtype == torch.float32 and cpu_attention.available():
        kernel = cpu_attention.paged_attention
        where = f"CPU, {torch.get_num_threads()} thread(s); the kernel: the C++ one (`cpu_attention`)"
    else:
        why = "fp32 only" if dtype != torch.float32 else cpu_attention.unavailable_reason()
        where = f"CPU, {torch.get_num_threads()} thread(s); no CPU kernel ({why}): only gather + SDPA is timed"
    baseline = None
    if a.baseline_source is not None:
        if kernel is not cpu_attention.paged_attention:
            parser.error("--baseline-source: the C++ CPU kernel in fp32 only")
        built = cpu_attention.build(a.baseline_source.resolve(), "angelspec_paged_attention_baseline",
                                    "the baseline CPU attention kernel")
        if isinstance(built, Exception):
            parser.error(f"--baseline-source did not build: {built}")
        if max(a.new) > cpu_attention.MAX_NEW_TOKENS:
            parser.error(f"--baseline-source: --new up to {cpu_attention.MAX_NEW_TOKENS} (longer rows go to the "
                         f"reference)")
        baseline = built.paged_attention
        kernel = cpu_attention._extension().paged_attention  # both compiled modules called alike
        where += f"; baseline: {a.baseline_source.name}"
    print(f"packed paged attention, one layer: {a.heads}/{a.kv_heads} heads of {a.head_dim}, pages of 16, "
          f"{str(dtype).removeprefix('torch.')}, {where}; ms per call, median of {a.repeats}")
    header = f"{'batch':>5} {'context':>7} {'new':>3} {'T':>5} | {'gather+SDPA':>11} {'kernel':>8} {'speed-up':>8} " \
             f"{'max|diff|':>9}" + (f" | {'baseline':>8} {'kernel vs baseline':>18}" if baseline else "")
    print(header)
    print("-" * len(header))
    for batch in a.batch:
        for context in a.context:
            for new in a.new:
                args, step = build(batch, context, new, a.heads, a.kv_heads, a.head_dim, dtype, device)
                step.groups(dtype)  # built once per step in the engine, outside the per-layer call

                def gathered(args=args, step=step):
                    return reference.paged_attention(*args, groups=step.groups)

                ms_ref = timed(gathered, a.repeats, cuda)
                row = f"{batch:>5} {context:>7} {new:>3} {batch * new:>5} | {ms_ref:>11.3f}"
                call = (lambda f, args: f(*args[:10], True)) if baseline else (lambda f, args: f(*args))
                if kernel is not None:
                    ms_kernel = timed(lambda args=args: call(kernel, args), a.repeats, cuda)
                    diff = (call(kernel, args).float() - gathered().float()).abs().max().item()
                    row += f" {ms_kernel:>8.3f} {ms_ref / ms_kernel:>7.2f}x {diff:>9.2e}"
                    if baseline is not None:
                        ms_base = timed(lambda args=args: call(baseline, args), a.repeats, cuda)
                        diff = max(diff, (call(baseline, args) - gathered()).abs().max().item())
                        row += f" | {ms_base:>8.3f} {ms_base / ms_kernel:>17.2f}x"
                else:
                    row += f" {'-':>8} {'-':>8} {'-':>9}"
                print(row, flush=True)
                del args, step
                if cuda:
                    torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
