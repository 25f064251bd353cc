"""The engine's Triton kernels compiled for real GPUs, without one (`scripts/gpu/compile_kernels.py`): every kernel
through Triton's whole pipeline to a cubin at the specialisations the launch wrappers produce, checked against the
shared memory one block may have. The other kernel tests run under Triton's interpreter, which accepts programs the
compiler rejects and knows no resource limits; on CUDA the same kernels run in `pytest -m gpu`."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

from angelspec_hf.tgi_patch.engine.kernels import triton_kernels as tk  # noqa: E402

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "gpu" / "compile_kernels.py"


def _compile(arch):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # (conftest.py sets it for the others)
    run = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--arch", str(arch)], env=env, capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-3000:]
    assert re.search(rf"\d+ specialisations compiled for sm_{arch}; 0 launches failed", run.stdout), run.stdout
    return run.stdout


def test_every_kernel_compiles_for_hopper_within_its_shared_memory():
    out = _compile(90)
    for wrapper in ("dcut_select", "verify", "verify_greedy", "paged_attention"):
        assert f"\n{wrapper} " in out  # each wrapper drove its kernel
    for branch in ("HAS_COST=True", "HAS_COST=False", "HAS_Q=True", "HAS_Q=False", "CAUSAL=True", "CAUSAL=False",
                   "FP32_DOT=True", "FP32_DOT=False"):
        assert f"{branch}" in out
    assert "over the" not in out  # on an H100 / H200 every first-choice tile fits


def test_an_fp32_tile_over_a_99_kib_gpu_falls_back_to_one_that_fits():
    """On sm_86 / sm_89 (A10, L4, RTX 30xx / 40xx) a block may have 99 KiB of shared memory: the fp32 prefill tile of
    a 128-wide head needs 113 KiB, so the launch fails before it runs and the wrapper takes the next, smaller tile."""
    out = _compile(86)
    over = re.search(r"\[CAUSAL=True, FP32_DOT=True, BLOCK_M=64, BLOCK_N=64, BLOCK_D=128\] needs (\d+) B of shared "
                     r"memory, over the 101376 B limit", out)
    assert over, out
    fallback = re.search(r"compiled \[CAUSAL=True, FP32_DOT=True, BLOCK_M=64, BLOCK_N=32, BLOCK_D=128\]: [\d.]+ s, "
                         r"shared (\d+) B", out)
    assert fallback and int(fallback.group(1)) <= 101376, out


@pytest.mark.parametrize("dtype_name,head_dim,rows", [("float32", 256, 300), ("bfloat16", 64, 1), ("float32", 128, 24)])
def test_the_tiles_tried_shrink_to_the_smallest(dtype_name, head_dim, rows):
    import torch

    tiles = tk.paged_attention_tiles(getattr(torch, dtype_name), head_dim, rows)
    assert tiles[-1] == (16, 16) and len(set(tiles)) == len(tiles)
    for (m0, n0), (m1, n1) in zip(tiles, tiles[1:]):
        assert m1 * n1 == m0 * n0 // 2 and m1 <= m0 and n1 <= n0  # each one half the last
