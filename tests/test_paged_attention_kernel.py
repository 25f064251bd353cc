"""The packed ragged paged-attention kernel (`triton_kernels.paged_attention`) against its torch reference
(`reference.paged_attention`: gather + SDPA), and the engine's target running through it. On CPU the kernel runs under
Triton's interpreter (`TRITON_INTERPRET=1`, set in conftest.py before anything imports triton) and the dispatch takes
it when `ANGELSPEC_FORCE_TRITON_ATTENTION=1`; on a GPU it runs natively (the tests marked `gpu`).

The pools are built by the engine's own `PagedKVPool` / `RaggedStep`, with their free pages shuffled so that each
sequence's pages lie out of order in the pool; every slot that holds no key is NaN, so a read of any slot the page
table does not name for a key a token may see turns the output into NaN."""

import pytest
import torch

from angelspec_hf.tgi_patch.engine import kernels
from angelspec_hf.tgi_patch.engine.kernels import reference
from angelspec_hf.tgi_patch.engine.kernels import triton_kernels as tk  # (needs the `kernels` extra: triton)
from angelspec_hf.tgi_patch.engine.paged import PagedKVPool, RaggedStep

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOLERANCE = {torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 2e-2}


def _case(held, new, heads, kv_heads, head_dim, dtype, seed, page_size=16, device=DEVICE):
    """A pool holding sequences of `held` tokens, each adding `new` this step (their keys/values written, as the
    engine writes them before attention), in slots taken out of order, and the packed queries `[T, H, D]` as the
    engine passes them (a transposed view of `[H, T, D]`). Returns the kernel's arguments and the step."""
    g = torch.Generator().manual_seed(seed)
    batch = len(held)
    pool = PagedKVPool(1, kv_heads, head_dim, dtype, device, max_seqs=batch + 3, page_size=page_size, num_pages=4)
    pool.free_pages = [pool.free_pages[i] for i in torch.randperm(len(pool.free_pages), generator=g)]
    slots_host = torch.randperm(batch + 3, generator=g)[:batch].tolist()
    # pages handed out a few at a time, sequence after sequence, so that the sequences' pages interleave
    for part in (1, 2, 3):
        pool.reserve(slots_host, [(h + n) * part // 3 for h, n in zip(held, new)])
        pool.free_pages = [pool.free_pages[i] for i in torch.randperm(len(pool.free_pages), generator=g)]
    pool.k[:, page_size:] = float("nan")
    pool.v[:, page_size:] = float("nan")
    slots = torch.tensor(slots_host, device=device)
    pool.set_lengths(slots_host, held)
    step = RaggedStep.build(pool, slots, torch.tensor(new, device=device), packed=True, slots_host=slots_host,
                            new_host=list(new))
    total = max(h + n for h, n in zip(held, new))
    positions = torch.arange(total, device=device).expand(batch, -1)
    valid = positions < (step.held + step.new)[:, None]
    index = pool.slot_index(slots, positions, valid)[valid]
    pool.k[0][index] = torch.randn(len(index), kv_heads, head_dim, generator=g).to(device, dtype)
    pool.v[0][index] = torch.randn(len(index), kv_heads, head_dim, generator=g).to(device, dtype)
    query = torch.randn(heads, sum(new), head_dim, generator=g).to(device, dtype).transpose(0, 1)  # [T, H, D]
    args = (query, pool.k[0], pool.v[0], pool.page_table, step.slots, step.held, step.new, step.starts(),
            head_dim ** -0.5 * 1.3, pool.page_size, step.held_host, step.new_host)
    return args, step


CASES = {  # held, new per sequence
    # decoding rows beside a prompt prefilled from scratch (held 0, new > 1) and a single-token prompt (held 0,
    # new 1); lengths cross page boundaries and the kernel's 64-key blocks without being multiples of either
    "mixed": ([5, 0, 70, 17, 0], [1, 40, 5, 3, 1]),
    "decode only": ([1, 16, 63, 64, 130], [1, 1, 1, 1, 1]),
    "drafts": ([33, 9, 100], [8, 5, 2]),
    "one prompt": ([0], [23]),
}


def _check(args, dtype):
    want = reference.paged_attention(*args)
    got = tk.paged_attention(*args)
    assert got.shape == want.shape and got.dtype == want.dtype == args[0].dtype
    assert not want.isnan().any()
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(got.float().cpu(), want.float().cpu(), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("heads,kv_heads", [(2, 2), (6, 2)], ids=["mha", "gqa3"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_kernel_matches_reference(name, heads, kv_heads, dtype):
    held, new = CASES[name]
    args, _ = _case(held, new, heads, kv_heads, 16, dtype, seed=len(name) + heads)
    _check(args, dtype)


@pytest.mark.parametrize("head_dim", [8, 24, 64])
def test_head_dims_below_the_tile_and_not_powers_of_two(head_dim):
    """D = 8 (a tiny test model's) and 24 are padded to the kernel's 16-/32-wide tile; 64 is SmolLM2's."""
    args, _ = _case([3, 0, 20], [2, 7, 1], 6, 2, head_dim, torch.float32, seed=head_dim)
    _check(args, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_whole_block_attention_matches_reference(name, dtype):
    """`causal=False` (a drafter's block): every new token sees all its sequence's keys, its block's included."""
    held, new = CASES[name]
    args, _ = _case(held, new, 6, 2, 16, dtype, seed=len(name))
    want = reference.paged_attention(*args, causal=False)
    got = tk.paged_attention(*args, causal=False)
    assert not want.isnan().any()
    torch.testing.assert_close(got.float().cpu(), want.float().cpu(), atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])
    # and it is not the causal result where a block has more than one token: its first token sees the rest
    first = args[7][[i for i, n in enumerate(new) if n > 1]]
    assert first.numel() or name == "decode only"
    assert first.numel() == 0 or not torch.allclose(got[first].float(), tk.paged_attention(*args)[first].float(), atol=1e-3)


def test_default_scaling_pages_of_another_size_and_a_contiguous_query():
    """`scaling=None` is `D ** -0.5`; pages of 8 tokens; a query that is not a view."""
    args, _ = _case([12, 0, 31], [3, 9, 1], 3, 1, 16, torch.float32, seed=3, page_size=8)
    args = (args[0].contiguous(), *args[1:8], None, *args[9:])
    _check(args, torch.float32)
    explicit = (*args[:8], 16 ** -0.5, *args[9:])
    torch.testing.assert_close(tk.paged_attention(*args), reference.paged_attention(*explicit), atol=2e-5, rtol=2e-5)


def test_reference_builds_the_groups_the_step_caches():
    """The reference gives the same result whether it builds its groups or takes the step's cached ones, and those
    are what the engine's attention gathered before the kernel existed: each group's pool slots are the step's
    `gather_index` rows, its mask the causal mask over the step's `key_valid` (the same tensors, so the same SDPA)."""
    args, step = _case(*CASES["mixed"], 6, 2, 16, torch.float32, seed=0)
    torch.testing.assert_close(reference.paged_attention(*args, groups=step.groups), reference.paged_attention(*args),
                               atol=0, rtol=0)
    bucket = [max(n - 1, 0).bit_length() for n in step.new_host]
    for group, b in zip(step.groups(torch.float32), sorted(set(bucket))):
        rows = torch.tensor([r for r, rb in enumerate(bucket) if rb == b])
        kv_max = group.gather_index.shape[1]
        assert kv_max == max(step.held_host[r] + step.new_host[r] for r in rows.tolist())
        assert torch.equal(group.gather_index, step.gather_index[rows, :kv_max])
        query_pos = step.held[rows, None] + torch.arange(group.n_max)[None, :]
        allowed = step.key_valid[rows, None, :kv_max] & (torch.arange(kv_max)[None, None, :] <= query_pos[:, :, None])
        assert torch.equal(group.mask, torch.zeros(allowed[:, None].shape).masked_fill(
            ~allowed[:, None], torch.finfo(torch.float32).min))


def test_bad_shapes_are_clear_errors():
    args, _ = _case([4], [2], 6, 2, 16, torch.float32, seed=1)
    query = args[0]
    with pytest.raises(ValueError, match="5 query heads are not a multiple of 2 KV heads"):
        tk.paged_attention(query[:, :5], *args[1:])
    big = torch.zeros(query.shape[0], 6, 272)
    cache = torch.zeros(args[1].shape[0], 2, 272)
    with pytest.raises(ValueError, match="head_dim 272 is above the kernel's limit of 256"):
        tk.paged_attention(big, cache, cache, *args[3:])
    empty = tk.paged_attention(query[:0], *args[1:])
    assert empty.shape == (0, 6, 16)


def test_dispatch_takes_the_kernel_when_forced(monkeypatch):
    """`kernels.paged_attention` runs the kernel under `ANGELSPEC_FORCE_TRITON_ATTENTION=1` (automatic on CUDA) and
    the reference otherwise, with the same result; `ANGELSPEC_FORCE_TRITON=1` (which forces the verification
    kernels) leaves attention on the reference."""
    from helpers import count_calls

    calls = count_calls(monkeypatch, kernel=(tk, "paged_attention"), reference=(reference, "paged_attention"))
    args, _ = _case([2, 0], [1, 5], 6, 2, 16, torch.float32, seed=2)
    results = {}
    monkeypatch.setenv("ANGELSPEC_CPU_ATTENTION", "0")  # not the C++ CPU kernel (test_cpu_paged_attention.py)
    monkeypatch.setenv("ANGELSPEC_FORCE_TRITON", "1")
    for force in ("", "1"):
        monkeypatch.setenv("ANGELSPEC_FORCE_TRITON_ATTENTION", force)
        results[force] = kernels.paged_attention(*args)
    if DEVICE == "cpu":
        assert calls == {"kernel": 1, "reference": 1}
    torch.testing.assert_close(results["1"], results[""], atol=2e-5, rtol=2e-5)


def _draft_rounds(drafter, in_place, device, rounds=3, force=False):
    """Drafts of three sequences in slots taken out of order, over `rounds` calls with ragged new-token counts, by
    a `BatchDrafter` whose attention reads the pool in place (`in_place=True`) or gathers it; `force`: in place
    whatever the device (the attention then runs the kernel's reference)."""
    from angelspec_hf.tgi_patch.engine.drafting import BatchDrafter
    from angelspec_hf.tgi_patch.engine.paged import DRAFT_POOL_ATTENTION

    target = drafter._test_target
    batch = BatchDrafter(drafter, target, max_seqs=5, kv_cache_tokens=64)
    if force:
        batch.in_place = True
        drafter.set_attn_implementation(DRAFT_POOL_ATTENTION)
    assert batch.in_place == in_place
    if in_place:
        assert drafter.config._attn_implementation == DRAFT_POOL_ATTENTION
    g = torch.Generator().manual_seed(0)
    width = drafter.fc.in_features if hasattr(drafter, "fc") else drafter.config.hidden_size
    slots_host = [3, 0, 2]
    slots = torch.tensor(slots_host, device=device)
    out = []
    for new_host in ([5, 1, 12], [2, 1, 4], [1, 3, 1])[:rounds]:
        n_max = max(new_host)
        features = torch.randn(3, n_max, width, generator=g).to(device)
        next_ids = torch.randint(3, 99, (3, n_max), generator=g).to(device)
        anchors = torch.randint(3, 99, (3,), generator=g).to(device)
        new = torch.tensor(new_host, device=device)
        select = lambda logits, j: (logits.argmax(-1), torch.softmax(logits.float(), -1),  # noqa: E731
                                    torch.softmax(logits.float(), -1).amax(-1))
        tokens, probs, _ = batch.draft(slots, features, next_ids, new, anchors, batch.num_draft_tokens, select,
                                       slots_host=slots_host, new_host=new_host)
        out.append((tokens.cpu(), probs.float().cpu()))
    return out


@pytest.mark.parametrize("family", ["dfly", "dflash", "mtp", "mtp_eagle3"])
@pytest.mark.parametrize("kernel", [False, True], ids=["reference", "kernel"])
def test_drafters_read_the_pool_in_place(monkeypatch, family, kernel):
    """Where the kernel reads the pool, the engine's drafters attend through it too (`PoolCache(in_place=True)`:
    DFlash/DFly's block over the whole context, MTP's new tokens and chained steps causally): the same drafts and
    distributions as gathering every sequence's keys, over rounds that add ragged token counts to slots out of order.
    `kernel=False` runs the in-place path on the reference attention (what checks the path itself on CPU)."""
    from angelspec_hf.tgi_patch.engine import paged
    from helpers import count_calls, tiny_drafter, tiny_target

    target = tiny_target().to(DEVICE)
    drafter = tiny_drafter(family, target).to(DEVICE)
    drafter._test_target = target
    monkeypatch.setenv("ANGELSPEC_CPU_ATTENTION", "0")  # not the C++ CPU kernel (test_cpu_paged_attention.py)
    monkeypatch.delenv("ANGELSPEC_FORCE_TRITON_ATTENTION", raising=False)
    gathered = _draft_rounds(drafter, in_place=False, device=DEVICE)
    calls = count_calls(monkeypatch, attend=(paged.PoolCache, "attend"), kernel=(tk, "paged_attention"))
    if kernel or DEVICE == "cuda":
        monkeypatch.setenv("ANGELSPEC_FORCE_TRITON_ATTENTION", "1")
        in_place = _draft_rounds(drafter, in_place=True, device=DEVICE)
    else:  # the same path with the kernel's reference computing the attention
        in_place = _draft_rounds(drafter, in_place=True, device=DEVICE, force=True)
    layers = drafter.config.num_hidden_layers
    assert calls["attend"] >= 3 * layers and calls["kernel"] == (calls["attend"] if kernel else 0)
    for (tokens, probs), (want_tokens, want_probs) in zip(in_place, gathered):
        torch.testing.assert_close(probs, want_probs, atol=1e-5, rtol=1e-4)
        assert torch.equal(tokens, want_tokens)
    # the attention implementation the drafter keeps is SDPA for every other caller: a gathering pool, the hook
    monkeypatch.delenv("ANGELSPEC_FORCE_TRITON_ATTENTION", raising=False)
    before = calls["attend"]
    for (tokens, probs), (want_tokens, want_probs) in zip(_draft_rounds(drafter, in_place=False, device=DEVICE),
                                                          gathered):
        torch.testing.assert_close(probs, want_probs, atol=0, rtol=0)
    assert calls["attend"] == before


@pytest.mark.gpu
def test_drafters_read_the_pool_in_place_on_cuda(monkeypatch):
    """The check above for every family, natively (the GPU playbook's `pytest -m gpu`)."""
    assert DEVICE == "cuda"
    for family in ("dfly", "dflash", "mtp", "mtp_eagle3"):
        test_drafters_read_the_pool_in_place(monkeypatch, family, kernel=True)


def _engine_matches_plain_greedy(monkeypatch, device, prompts, max_new_tokens):
    """The engine with its target's and its drafter's attention through the kernel (forced here; automatic on CUDA):
    every attention call over a pool runs the kernel, never the reference, some of them for decoding rows verifying
    several tokens (held > 0, new > 1) and some for the drafter's blocks, and the output is the target's own greedy
    output. Returns the engine."""
    from angelspec_hf.tgi_patch.engine import generate_batch
    from helpers import count_calls, tiny_drafter, tiny_target

    monkeypatch.setenv("ANGELSPEC_FORCE_TRITON_ATTENTION", "1")
    calls = count_calls(monkeypatch, kernel=(tk, "paged_attention"), reference=(reference, "paged_attention"))
    calls["verifying"], calls["block"], kernel = 0, 0, tk.paged_attention

    def verifying(*args):  # calls for a step with a sequence that holds keys and adds several (a draft verified)
        calls["verifying"] += any(h > 0 and n > 1 for h, n in zip(args[10], args[11]))
        calls["block"] += args[13] is False  # the drafter's block (DFly), read in place
        return kernel(*args)

    monkeypatch.setattr(tk, "paged_attention", verifying)
    target, twin = tiny_target().to(device), tiny_target().to(device)  # the twin keeps eager attention
    drafter = tiny_drafter("dfly", target).to(device)
    outputs, engine = generate_batch(target, drafter, prompts, max_new_tokens=max_new_tokens, verify="full",
                                     return_engine=True)
    assert calls["kernel"] > 0 and calls["verifying"] > 0 and calls["block"] > 0 and calls["reference"] == 0
    for prompt, out in zip(prompts, outputs):
        plain = twin.generate(torch.tensor([prompt], device=device), max_new_tokens=max_new_tokens, do_sample=False,
                              eos_token_id=2, pad_token_id=0)
        assert out == plain[0, len(prompt):].tolist()
    return engine


def test_engine_through_the_kernel_stays_plain_greedy(monkeypatch):
    # interpreted, each (sequence, KV head) program costs milliseconds in every layer: a short run
    _engine_matches_plain_greedy(monkeypatch, DEVICE, [[5, 6, 7], [3, 4, 5, 3, 4] * 4], max_new_tokens=6)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"])
def test_kernel_matches_reference_natively_on_cuda(dtype):
    """The GPU playbook's `pytest -m gpu` run: every case above compiled for the device (bf16 too, which the
    interpreter computes wrongly), plus SmolLM2's shapes (H 9, Hkv 3, D 64) on long contexts."""
    assert DEVICE == "cuda"
    for name in sorted(CASES):
        for heads, kv_heads in ((2, 2), (6, 2)):
            args, _ = _case(*CASES[name], heads, kv_heads, 16, dtype, seed=len(name) + heads)
            _check(args, dtype)
    for held, new in (([2000, 300, 1000, 0], [1, 8, 4, 600]), ([255] * 32, [3] * 32)):
        args, _ = _case(held, new, 9, 3, 64, dtype, seed=7)
        _check(args, dtype)


@pytest.mark.gpu
def test_engine_through_the_kernel_stays_plain_greedy_on_cuda(monkeypatch):
    """Natively, with more requests and tokens: drafts are accepted, so rows keep verified keys and drop rejected
    ones between steps."""
    assert DEVICE == "cuda"
    prompts = [[5, 6, 7], [9] * 11, [4, 3], [3, 4, 5, 3, 4] * 4, [7] * 40, [8, 9]]
    engine = _engine_matches_plain_greedy(monkeypatch, "cuda", prompts, max_new_tokens=24)
    assert engine.stats["accepted"] > 0
