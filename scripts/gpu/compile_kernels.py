"""Compile every Triton kernel of the engine for a GPU architecture without a GPU, at the specialisations the engine
launches, and report what each needs:

    python scripts/gpu/compile_kernels.py                 # sm_90 (H100 / H200), every case
    python scripts/gpu/compile_kernels.py --arch 80 --quick

The CPU tests run the kernels under Triton's interpreter, which accepts programs the compiler rejects (a loop-carried
value whose type changes, an unsupported cast) and knows no resource limits. This script drives each kernel's own
launch wrapper (`triton_kernels.dcut_select`, `verify`, `verify_greedy`, `paged_attention`) with inputs shaped and
typed as the engine passes them, intercepts the launch, derives the signature the JIT would (Triton's own argument
specialisation: pointer dtypes, integers equal to 1 folded to constants, 16-divisibility hints) and compiles it
through Triton's whole pipeline down to a cubin (`triton.compile` with a `GPUTarget`; ptxas ships with Triton). For
each it prints the constexprs, compile time, shared memory, registers and spill stores (from the cubin, with the
`cuobjdump` that ships with Triton), and fails when a kernel does not compile or needs more shared memory than one
block may have on that architecture. Exit status: 0 when every case compiles within the limits.

It needs Triton but no GPU and no driver; it must run without `TRITON_INTERPRET` (the interpreter replaces the
kernels with Python functions)."""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

# the most shared memory one block may use (opt-in), per compute capability
SHARED_LIMIT = {70: 96 << 10, 75: 64 << 10, 80: 163 << 10, 86: 99 << 10, 87: 163 << 10, 89: 99 << 10,
                90: 227 << 10, 100: 227 << 10, 120: 99 << 10}


class StandIn:
    """Stands in for a `@triton.jit` kernel: `kernel[grid](*args, **kwargs)` compiles the launch's specialisation
    for the target instead of launching it (once per specialisation) and, like a launch on that GPU, raises
    `OutOfResources` when it needs more shared memory than a block may have, so the wrapper's fallback runs."""

    def __init__(self, fn, compile_one):
        self.fn, self.compile_one = fn, compile_one

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.compile_one(self.fn, args, kwargs)


def specialise(fn, args, kwargs):
    """The (signature, constexprs, attrs) the JIT derives for `fn(*args, **kwargs)`, by Triton's own rules."""
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend

    signature, constexprs, attrs = {}, {}, {}
    values = dict(zip(fn.arg_names, args)) | kwargs
    for i, param in enumerate(fn.params):
        name, value = param.name, values[param.name]
        if param.is_constexpr:
            signature[name], constexprs[name] = "constexpr", value
            continue
        ty, spec = native_specialize_impl(BaseBackend, value, False, not param.do_not_specialize,
                                          not param.do_not_specialize_on_alignment)
        if ty == "constexpr":  # an integer equal to 1
            signature[name], constexprs[name] = "constexpr", spec
            continue
        signature[name] = ty
        if spec:
            attrs[(i,)] = BaseBackend.parse_attr(spec)
    return signature, constexprs, attrs


def resource_usage(cubin: bytes) -> dict:
    """Registers, spill stores and shared memory of a cubin, read with the cuobjdump that ships with Triton."""
    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    tool = str(tool) if tool.exists() else shutil.which("cuobjdump")
    if not tool:
        return {}
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
    usage = {key.lower(): int(v) for key, v in re.findall(r"\b(REG|STACK|SHARED|LOCAL):(\d+)", out)}
    return usage


def cases(quick: bool):
    """(label, wrapper name, args, kwargs) for each launch to compile: the engine's dtypes and the buckets its shapes
    fall into. The pool and step of the attention cases are built by the engine's own `PagedKVPool` / `RaggedStep`."""
    import torch

    from angelspec_hf.tgi_patch.engine.paged import PagedKVPool, RaggedStep

    out = []
    # D-Cut selection: the batch and batch x K keys padded to powers of two; K = 1 is folded to a constant
    shapes = [(1, 1), (3, 5)] if quick else [(1, 1), (1, 8), (3, 5), (8, 8), (32, 8), (64, 8), (64, 16)]
    for batch, k in shapes:
        for cost in (False, True):
            accept = torch.rand(batch, k)
            drafted = torch.full((batch,), k, dtype=torch.long)
            step_cost = torch.linspace(1, 2, batch * k + 1) if cost else None
            out.append((f"batch {batch}, K {k}, cost {cost}", "dcut_select", (accept, drafted, 7, step_cost, 0.5), {}))
    # verification with draft probabilities (rejection sampling) or without, over the target's and a pruned vocabulary
    for vocab in (49152,) if quick else (49152, 8192, 151936):
        for has_q in (False, True):
            batch, k = 4, 8
            scores = torch.randn(batch, k + 1, vocab)
            q = torch.rand(batch, k, vocab) if has_q else None
            out.append((f"vocab {vocab}, q {has_q}", "verify",
                        (scores, torch.zeros(batch, k, dtype=torch.long), q, torch.full((batch,), k), torch.ones(batch),
                         torch.rand(batch, k), torch.rand(batch, k + 1)), {}))
    # greedy verification straight from the packed logits, in the model's dtype
    for dtype in (torch.bfloat16, torch.float32) if quick else (torch.bfloat16, torch.float16, torch.float32):
        rows, span, vocab = 4, 9, 49152
        logits = torch.randn(rows * span, vocab).to(dtype)
        positions = torch.arange(rows * span).view(rows, span)
        out.append((f"{str(dtype)[6:]}", "verify_greedy",
                    (logits, positions, torch.zeros(rows, span - 1, dtype=torch.long), torch.full((rows,), span - 1)),
                    {}))
    # paged attention: (query heads, KV heads, head_dim) of SmolLM2-135M, Llama-style GQA, and the widest head
    geometries = [(9, 3, 64), (32, 8, 128), (16, 16, 128), (8, 2, 256)]
    dtypes = (torch.bfloat16, torch.float32) if quick else (torch.bfloat16, torch.float16, torch.float32)
    # new tokens per sequence: decoding (a 16-row tile), drafts of 8 (32 or 64 rows), a prefill (64-row tiles)
    steps = [([1, 1], [40, 3]), ([8, 5], [20, 70]), ([100, 1], [0, 30])]
    combos = [(g, dtype, causal, step) for g in geometries for dtype in dtypes for causal in (True, False)
              for step in steps]
    if quick:  # the embedded target's geometry in every branch, and the fp32 prefill of a 128-wide head (the tile
        # that is over the shared memory of a 99 KiB GPU, sm_86 / sm_89, so that the wrapper falls back)
        combos = [c for c in combos if c[0] == geometries[0] and c[3] in (steps[0], steps[2])]
        combos.append((geometries[1], torch.float32, True, steps[2]))
    for (heads, kv_heads, head_dim), dtype, causal, (new, held) in combos:
        pool = PagedKVPool(1, kv_heads, head_dim, dtype, "cpu", max_seqs=4, num_pages=32)
        slots_host = [0, 2]
        pool.reserve(slots_host, [h + n for h, n in zip(held, new)])
        pool.set_lengths(slots_host, held)
        step = RaggedStep.build(pool, torch.tensor(slots_host), torch.tensor(new), packed=True,
                                slots_host=slots_host, new_host=list(new))
        query = torch.empty(heads, sum(new), head_dim, dtype=dtype).transpose(0, 1)  # as the engine packs
        args = (query, pool.k[0], pool.v[0], pool.page_table, step.slots, step.held, step.new,
                step.starts(), head_dim ** -0.5, pool.page_size, step.held_host, step.new_host)
        label = f"{heads}/{kv_heads} heads, d {head_dim}, {str(dtype)[6:]}, causal {causal}, new {new}"
        out.append((label, "paged_attention", args, {"causal": causal}))
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", type=int, default=90, help="compute capability x 10 (90: H100 / H200)")
    parser.add_argument("--quick", action="store_true", help="fewer shapes: one case per bucket that matters")
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        parser.error("TRITON_INTERPRET=1 replaces the kernels with Python functions: run without it")
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.errors import OutOfResources

    from angelspec_hf.tgi_patch.engine.kernels import triton_kernels as tk

    target = GPUTarget("cuda", args.arch, 32)
    limit = SHARED_LIMIT.get(args.arch)
    print(f"triton {triton.__version__}, target sm_{args.arch} (shared memory limit "
          f"{'unknown' if limit is None else f'{limit} B'} a block)")
    compiled = {}  # specialisation -> shared memory bytes

    def compile_one(fn, call_args, call_kwargs):
        signature, constexprs, attrs = specialise(fn, call_args, call_kwargs)
        key = (fn.fn.__name__, tuple(signature.items()), tuple(sorted((k, repr(v)) for k, v in constexprs.items())),
               tuple(sorted(attrs)))
        shown = ", ".join(f"{k}={v}" for k, v in constexprs.items())
        if key not in compiled:
            start = time.perf_counter()
            kernel = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs),
                                    target=target)
            seconds = time.perf_counter() - start
            compiled[key] = kernel.metadata.shared
            usage = resource_usage(kernel.asm["cubin"])
            print(f"    compiled [{shown}]: {seconds:.1f} s, shared {kernel.metadata.shared} B"
                  + (f", {usage['reg']} registers, {usage.get('local', 0)} B local (spills)" if "reg" in usage else ""))
        if limit is not None and compiled[key] > limit:
            print(f"    [{shown}] needs {compiled[key]} B of shared memory, over the {limit} B limit: not launchable")
            raise OutOfResources(compiled[key], limit, "shared memory")

    kernels = {name: getattr(tk, name) for name in dir(tk) if isinstance(getattr(tk, name), triton.JITFunction)
               and getattr(tk, name).fn.__name__.endswith("_kernel")}
    for name, fn in kernels.items():
        setattr(tk, name, StandIn(fn, compile_one))
    tk._ATTENTION_TILES.clear()
    failures = 0
    try:
        for label, wrapper, call_args, call_kwargs in cases(args.quick):
            print(f"{wrapper} {label}")
            try:
                getattr(tk, wrapper)(*call_args, **call_kwargs)
            except Exception as e:  # noqa: BLE001 (every failure is reported, then the next case runs)
                failures += 1
                print(f"FAIL {wrapper} {label}: {type(e).__name__}: {str(e).strip()[:2000]}")
    finally:
        for name, fn in kernels.items():
            setattr(tk, name, fn)
        tk._ATTENTION_TILES.clear()
    print(f"{len(compiled)} specialisations compiled for sm_{args.arch}; {failures} launches failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
