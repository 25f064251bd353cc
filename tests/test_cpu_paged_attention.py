"""The packed target's attention on a CPU in fp32 (`kernels.cpu_attention`, C++ compiled on first use) against its
torch reference (`reference.paged_attention`: gather + SDPA), the dispatch that picks it, and the engine running
through it. The pools are those of `test_paged_attention_kernel.py`: pages shuffled, every slot that holds no key
NaN, so a read of any slot the page table does not name for a key a token may see turns the output into NaN."""

import pytest
import torch
from helpers import tiny_drafter, tiny_target
from test_paged_attention_kernel import CASES, _case, _draft_rounds

from angelspec_hf.tgi_patch.engine import generate_batch, kernels
from angelspec_hf.tgi_patch.engine.kernels import cpu_attention, reference

pytestmark = pytest.mark.skipif(not cpu_attention.available(),
                                reason=f"the CPU paged-attention kernel did not build here: "
                                       f"{cpu_attention.unavailable_reason()}")


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "whole blocks"])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(2, 2, 16), (6, 2, 16), (9, 3, 64), (4, 1, 24)],
                         ids=["mha", "gqa3", "smollm2", "mqa-d24"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_cpu_kernel_matches_reference(name, heads, kv_heads, head_dim, causal):
    args, _ = _case(*CASES[name], heads, kv_heads, head_dim, torch.float32, seed=len(name) + heads, device="cpu")
    want = reference.paged_attention(*args, causal=causal)
    got = cpu_attention.paged_attention(*args, causal=causal)
    assert not want.isnan().any() and not got.isnan().any()
    assert got.shape == want.shape and got.dtype == torch.float32
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


def test_cpu_kernel_long_contexts_and_default_scaling():
    """SmolLM2's shapes on contexts of hundreds of tokens (the engine's decode steps and verifies), and `scaling`
    None meaning `D ** -0.5` as in the reference."""
    args, _ = _case([700, 255, 0, 31] + [128] * 12, [1, 9, 300, 4] + [1] * 12, 9, 3, 64, torch.float32, seed=3,
                    device="cpu")
    args = args[:8] + (None,) + args[9:]
    want = reference.paged_attention(*args)
    torch.testing.assert_close(cpu_attention.paged_attention(*args), want, atol=2e-5, rtol=2e-5)  # 300: the reference
    torch.testing.assert_close(cpu_attention.paged_attention(*args[:10]), want, atol=2e-5, rtol=2e-5)  # all the kernel


def test_cpu_kernel_pages_of_8_and_sequences_adding_nothing():
    """Pages of another size, and a sequence that adds no token this step (it owns no query row: skipped)."""
    args, _ = _case([40, 3, 17], [2, 1, 6], 6, 2, 16, torch.float32, seed=5, page_size=8, device="cpu")
    query, k, v, table, slots, held = args[:6]
    new, starts = torch.tensor([2, 0, 6]), torch.tensor([0, 2, 2])
    query = torch.cat([query[0:2], query[3:9]])  # the first and the last sequence's rows
    trimmed = (query, k, v, table, slots, held, new, starts, *args[8:10], args[10], new.tolist())
    got = cpu_attention.paged_attention(*trimmed)
    assert args[9] == 8 and got.shape == (8, 6, 16) and not got.isnan().any()
    torch.testing.assert_close(got, reference.paged_attention(*trimmed), atol=2e-5, rtol=2e-5)


def test_cpu_kernel_rejects_what_would_read_outside_its_tensors():
    """A slot outside the page table, a sequence longer than its page-table row, new tokens past the query: clear
    errors, not reads of other memory."""
    args, _ = _case(*CASES["drafts"], 6, 2, 16, torch.float32, seed=4, device="cpu")
    query, k, v, table, slots, held, new, starts = args[:8]
    bad = {"a slot outside the page table": (query, k, v, table, slots + table.shape[0], held, new, starts),
           "a sequence longer than its page-table row": (query, k, v, table, slots, held + 16 * table.shape[1], new,
                                                         starts),
           "new tokens outside the query": (query, k, v, table, slots, held, new, starts + query.shape[0])}
    for what, call in bad.items():
        with pytest.raises(RuntimeError, match=what.split(" ")[-1]):
            cpu_attention.paged_attention(*call, None, 16)


def _record_calls(monkeypatch, note) -> None:
    """Wrap the kernel's and the reference's `paged_attention` so that each call first runs `note(name, args)`
    (name "cpu" or "reference"); `helpers.count_calls` counts, these tests need the order or the arguments."""
    for module, name in ((cpu_attention, "cpu"), (reference, "reference")):
        original = module.paged_attention

        def recorded(*a, _original=original, _name=name, **k):
            note(_name, a)
            return _original(*a, **k)

        monkeypatch.setattr(module, "paged_attention", recorded)


def test_dispatch_takes_the_cpu_kernel_for_fp32_only(monkeypatch):
    """`kernels.paged_attention` runs the C++ kernel for fp32 CPU tensors (a sequence adding more than
    `MAX_NEW_TOKENS`, a prompt's prefill, through the reference within it), the reference for other dtypes, for a
    query that needs a gradient, and with `ANGELSPEC_CPU_ATTENTION=0`."""
    calls = []
    _record_calls(monkeypatch, lambda name, args: calls.append(name))
    args, _ = _case(*CASES["drafts"], 6, 2, 16, torch.float32, seed=1, device="cpu")
    kernels.paged_attention(*args)
    half, _ = _case(*CASES["drafts"], 6, 2, 16, torch.bfloat16, seed=1, device="cpu")
    kernels.paged_attention(*half)
    kernels.paged_attention(args[0].clone().requires_grad_(), *args[1:])
    prefill, _ = _case([0, 5], [cpu_attention.MAX_NEW_TOKENS + 1, 1], 6, 2, 16, torch.float32, seed=1, device="cpu")
    kernels.paged_attention(*prefill)
    monkeypatch.setenv("ANGELSPEC_CPU_ATTENTION", "0")
    kernels.paged_attention(*args)
    assert calls == ["cpu", "reference", "reference", "cpu", "reference", "reference"]


@pytest.mark.parametrize("verify", ["full", "auto"])
def test_engine_through_the_cpu_kernel_stays_plain_greedy(monkeypatch, verify):
    """The engine's target attends through the kernel (the reference only for sequences adding more than
    `MAX_NEW_TOKENS`: prompts' prefills), drafts are accepted, and every output is plain greedy decoding's (the twin
    runs transformers' own attention)."""
    calls = {"cpu": [], "reference": []}  # the tokens each sequence adds, per call
    _record_calls(monkeypatch, lambda name, args: calls[name].append(list(args[11])))
    prompts = [[5, 6, 7], [9] * 11, [4, 3], [3, 4, 5, 3, 4] * 4, [7] * 40, [8, 9]]
    target, twin = tiny_target(), tiny_target()
    drafter = tiny_drafter("dfly", target)
    outputs, engine = generate_batch(target, drafter, prompts, max_new_tokens=24, verify=verify, return_engine=True)
    # its cost profiles are keyed apart, by the kernel's version and the drafter's attention through it too
    assert engine.runner.attention_kind == f"cpu-kernel:{cpu_attention.source_version()};drafter"
    assert engine.runner.batch_drafter.in_place
    assert calls["cpu"] and calls["reference"]  # the 40-token prompt's prefill, beside others
    assert all(n > cpu_attention.MAX_NEW_TOKENS for new in calls["reference"] for n in new)
    assert engine.stats["accepted"] > 0
    for prompt, out in zip(prompts, outputs):
        plain = twin.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False, eos_token_id=2,
                              pad_token_id=0)
        assert out == plain[0, len(prompt):].tolist()


@pytest.mark.parametrize("family", ["dfly", "dflash", "mtp", "mtp_eagle3"])
def test_drafters_read_their_pool_through_the_cpu_kernel(monkeypatch, family):
    """On a CPU in fp32 the engine's drafters attend through the kernel too (`BatchDrafter.in_place`: DFlash / DFly
    blocks over the whole context, MTP's new tokens and chained steps causally), with the same drafts and
    distributions as gathering every sequence's keys (`ANGELSPEC_CPU_ATTENTION=0`), over rounds that add ragged token
    counts to slots taken out of order."""
    target = tiny_target()
    drafter = tiny_drafter(family, target)
    drafter._test_target = target
    monkeypatch.setenv("ANGELSPEC_CPU_ATTENTION", "0")
    gathered = _draft_rounds(drafter, in_place=False, device="cpu")
    monkeypatch.delenv("ANGELSPEC_CPU_ATTENTION")
    calls = {"cpu": [], "reference": []}
    _record_calls(monkeypatch, lambda name, args: calls[name].append(list(args[11])))
    in_place = _draft_rounds(drafter, in_place=True, device="cpu")
    assert len(calls["cpu"]) >= 3 * drafter.config.num_hidden_layers
    if family in ("dfly", "dflash"):  # the blocks' rows, whole: more than one row per sequence through the kernel
        assert any(n == drafter.config.block_size for new in calls["cpu"] for n in new)
    for (tokens, probs), (want_tokens, want_probs) in zip(in_place, gathered):
        torch.testing.assert_close(probs, want_probs, atol=1e-5, rtol=1e-4)
        assert torch.equal(tokens, want_tokens)
