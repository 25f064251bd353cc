"""One DFly layer's training attention, forward and backward, at the CPU recipe's shapes: dense SDPA under the packed
blocks' mask (what training ran before `--block_sparse_attention`) against `trainer/block_attention.py` (eager and
compiled), on random inputs, interleaved, median of `--repeats`.

    python benchmarks/block_attention.py --threads 1

Shapes: 4 sequences of `--context` tokens, `--anchors` blocks of 8 each, SmolLM2-135M's 9 query and 3 key/value heads
of 64, anchors drawn at random (each block sees the context before its anchor and its own 8 rows)."""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from angelspec_hf.modeling.drafter_utils import additive_mask
from angelspec_hf.trainer.block_attention import block_attention


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--anchors", type=int, default=128)
    parser.add_argument("--context", type=int, default=252)
    parser.add_argument("--repeats", type=int, default=5)
    a = parser.parse_args()
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    n, heads, kv_heads, dim, block = 4, 9, 3, 64, 8
    anchors = torch.sort(torch.randint(1, a.context, (n, a.anchors)), -1).values
    sees = (torch.arange(a.context)[None, None, :] < anchors[..., None]).repeat_interleave(block, dim=1)
    of = torch.arange(a.anchors).repeat_interleave(block)
    keep = torch.cat([sees, (of[:, None] == of[None, :]).expand(n, -1, -1)], dim=2)
    module = type("Attention", (), {"config": type("Config", (), {"block_size": block})()})()
    print(f"{n} sequences x {a.anchors} blocks of {block}, {a.context} context tokens, {heads}/{kv_heads} heads of "
          f"{dim}, {a.threads} thread(s); seconds per forward + backward (median of {a.repeats})")
    for dtype in (torch.float32, torch.bfloat16):
        query = torch.randn(n, heads, a.anchors * block, dim, dtype=dtype, requires_grad=True)
        key, value = (torch.randn(n, kv_heads, a.context + a.anchors * block, dim, dtype=dtype, requires_grad=True)
                      for _ in range(2))
        full, context = additive_mask(keep, dtype)[:, None], additive_mask(sees, dtype)[:, None]

        def dense():
            return torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=full,
                                                                    enable_gqa=True)

        def sparse():
            return block_attention(module, query, key, value, context)[0].transpose(1, 2)

        compiled = torch.compile(sparse)
        error = (dense().float() - sparse().float()).abs().max().item()
        times = {name: [] for name in ("dense SDPA", "block-sparse", "block-sparse compiled")}
        for fn in (dense, sparse, compiled):  # warm-up (and compile)
            fn().sum().backward()
        for _ in range(a.repeats):
            for name, fn in zip(times, (dense, sparse, compiled)):
                began = time.perf_counter()
                fn().sum().backward()
                times[name].append(time.perf_counter() - began)
        line = "  ".join(f"{name} {statistics.median(t):.3f}" for name, t in times.items())
        print(f"{str(dtype).removeprefix('torch.'):>8}: {line}  (max |dense - sparse| {error:.1e})", flush=True)


if __name__ == "__main__":
    main()
