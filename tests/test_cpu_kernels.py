"""Linears on packed weights (`angelspec_hf.cpu_kernels`: oneDNN, MKL, the weight-streaming kernel): the same
function as `nn.Linear`, the same parameters (state dict, tied embeddings, training), and speculative decoding on a
packed target stays lossless."""

import copy
import io

import pytest
import torch
from torch import nn

from angelspec_hf.cpu_kernels import (MKL_MIN_ROWS, MKL_ROWS, STREAM_MAX_ROWS, STREAM_MIN_ROWS, PrepackedLinear,
                                      is_prepacked, mkl_pack_available, prepack_available, prepack_linears,
                                      stock_linears, stream_available, stream_unavailable_reason, use_linear_kernels)
from helpers import tiny_drafter, tiny_target

pytestmark = pytest.mark.skipif(not prepack_available(), reason="this PyTorch build has no oneDNN (MKL-DNN)")


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(1, 24), (5, 24), (2, 8, 24), (3, 1, 24)])
def test_prepacked_linear_computes_what_nn_linear_does(shape, bias):
    torch.manual_seed(0)
    linear = nn.Linear(24, 40, bias=bias)
    packed = PrepackedLinear.from_linear(linear)
    x = torch.randn(*shape)
    with torch.no_grad():
        out, ref = packed(x), linear(x)
    assert packed._packed is not None  # the oneDNN path ran, not the fallback
    assert out.shape == ref.shape and torch.allclose(out, ref, atol=1e-5, rtol=1e-5)


needs_mkl = pytest.mark.skipif(not mkl_pack_available(), reason="this PyTorch build has no MKL packed GEMM")
needs_stream = pytest.mark.skipif(
    not stream_available(), reason=f"the weight-streaming kernel did not build here: {stream_unavailable_reason()}")


@needs_mkl
@pytest.mark.parametrize("bias", [True, False])
def test_mkl_packed_linear_computes_what_nn_linear_does_at_every_row_count(bias):
    """MKL-packed linears: forwards of `MKL_MIN_ROWS`..`MKL_ROWS` rows (padded with zero rows) read the packed copy,
    every other row count the stock kernel; all compute `nn.Linear`'s function."""
    torch.manual_seed(0)
    linear = nn.Linear(24, 40, bias=bias)
    packed = PrepackedLinear.from_linear(linear, "mkl")
    for rows in range(1, MKL_ROWS + 4):
        x = torch.randn(1, rows, 24)
        with torch.no_grad():
            out, ref = packed(x), linear(x)
        assert out.shape == ref.shape and torch.allclose(out, ref, atol=1e-5, rtol=1e-5), rows
        assert (packed._packed is not None) == (rows >= MKL_MIN_ROWS), rows  # packed only once that size ran
    with torch.enable_grad():  # training takes the stock kernel
        x = torch.randn(MKL_ROWS, 24, requires_grad=True)
        packed(x).sum().backward()
    assert x.grad is not None


@pytest.mark.parametrize("library, low, high", [pytest.param("mkl", MKL_MIN_ROWS, MKL_ROWS, marks=needs_mkl),
                                                 pytest.param("stream", STREAM_MIN_ROWS, STREAM_MAX_ROWS,
                                                              marks=needs_stream)])
def test_a_packed_row_does_not_depend_on_the_other_rows(library, low, high):
    """What makes packed verification safe (MKL's zero padding, the streaming kernel's tiles): each row's output is
    the same, bit for bit, whatever the other rows of the forward hold and however many there are, and wherever it
    sits among them: a token is verified alike in every round."""
    torch.manual_seed(0)
    packed = PrepackedLinear.from_linear(nn.Linear(96, 80), library)
    x = torch.randn(high, 96)
    with torch.no_grad():
        full = packed(x)
        for rows in range(low, high):
            assert torch.equal(packed(x[:rows]), full[:rows]), rows
        shifted = packed(torch.cat([x[1:], torch.randn(1, 96)]))
    assert torch.equal(shifted[: high - 1], full[1:])


@needs_mkl
def test_mkl_kernels_are_applied_switched_and_undone():
    target = tiny_target()
    line = use_linear_kernels("mkl", target)
    assert line == f"MKL-packed for {MKL_MIN_ROWS}-{MKL_ROWS}-token forwards, stock otherwise (29 linears)"
    assert is_prepacked(target, "mkl") and not is_prepacked(target, "onednn")
    assert use_linear_kernels("prepacked", target) == "oneDNN prepacked (29 linears)"  # the same modules, repacked
    assert is_prepacked(target, "onednn") and not is_prepacked(target, "mkl")
    assert use_linear_kernels("stock", target).startswith("stock") and not is_prepacked(target)
    with pytest.raises(ValueError, match="library"):
        prepack_linears(target, "openblas")


@needs_stream
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("features", [(24, 40), (130, 96), (96, 33)])  # reductions across chunks, partial blocks
def test_stream_linear_computes_what_nn_linear_does_at_every_row_count(features, bias):
    """The weight-streaming kernel: forwards of `STREAM_MIN_ROWS`..`STREAM_MAX_ROWS` rows read its packed copy, every
    other row count the stock kernel; all compute `nn.Linear`'s function."""
    torch.manual_seed(0)
    linear = nn.Linear(*features, bias=bias)
    packed = PrepackedLinear.from_linear(linear, "stream")
    for rows in range(1, STREAM_MAX_ROWS + 4):
        x = torch.randn(1, rows, features[0])
        with torch.no_grad():
            out, ref = packed(x), linear(x)
        assert out.shape == ref.shape and torch.allclose(out, ref, atol=1e-5, rtol=1e-5), rows
        assert (packed._packed is not None) == (rows >= STREAM_MIN_ROWS), rows  # packed once that size first ran
    with torch.enable_grad():  # training takes the stock kernel
        x = torch.randn(STREAM_MAX_ROWS, features[0], requires_grad=True)
        packed(x).sum().backward()
    assert x.grad is not None


@needs_stream
def test_stream_linear_rounds_like_mkl_at_the_targets_sizes():
    """At the embedded target's sizes (576 -> 1536 and 1536 -> 576) the kernel's error against a float64 product is
    of the order of MKL's: the reduction is summed in chunks, not left to right over 1,536 terms."""
    torch.manual_seed(0)
    for n_in, n_out in ((576, 1536), (1536, 576)):
        linear = nn.Linear(n_in, n_out, bias=False)
        packed = PrepackedLinear.from_linear(linear, "stream")
        x = torch.randn(9, n_in)
        exact = x.double() @ linear.weight.double().T
        with torch.no_grad():
            ours = (packed(x).double() - exact).abs().max()
            mkl = (linear(x).double() - exact).abs().max()
        assert ours <= 3 * mkl, (n_in, float(ours), float(mkl))


@needs_stream
def test_stream_kernels_are_applied_switched_and_undone():
    target = tiny_target()
    line = use_linear_kernels("stream", target)
    assert line == (f"weight-streaming kernel for {STREAM_MIN_ROWS}-{STREAM_MAX_ROWS}-token forwards, stock "
                    f"otherwise (29 linears)")
    assert is_prepacked(target, "stream") and not is_prepacked(target, "onednn")
    assert use_linear_kernels("prepacked", target) == "oneDNN prepacked (29 linears)"  # the same modules, repacked
    assert is_prepacked(target, "onednn") and not is_prepacked(target, "stream")
    assert use_linear_kernels("stock", target).startswith("stock") and not is_prepacked(target)


@needs_stream
def test_the_stream_kernel_adds_the_bias_to_each_sum_and_keeps_the_leading_dimensions():
    """The kernel takes rows of any leading shape (contiguous or not) and adds the bias to each finished sum: bit for
    bit the product without bias plus the bias, and a bias that does not fit is named."""
    from angelspec_hf.cpu_kernels import _built_stream_extension

    kernel = _built_stream_extension()
    torch.manual_seed(0)
    weight, bias = torch.randn(70, 40), torch.randn(70)  # 70: a partial last block of 32 columns
    packed = kernel.pack(weight)
    x = torch.randn(2, 5, 40)
    out = kernel.linear(x, packed, 70, bias)
    assert out.shape == (2, 5, 70)
    assert torch.equal(out, kernel.linear(x.reshape(10, 40), packed, 70).reshape(2, 5, 70) + bias)
    strided = x.transpose(0, 1)
    assert torch.equal(kernel.linear(strided, packed, 70), kernel.linear(strided.contiguous(), packed, 70))
    assert torch.allclose(out, nn.functional.linear(x, weight, bias), atol=1e-5, rtol=1e-5)
    with pytest.raises(RuntimeError, match="a bias of 70 fp32 values"):
        kernel.linear(x, packed, 70, torch.randn(69))
    with pytest.raises(RuntimeError, match="does not fit rows"):
        kernel.linear(torch.randn(3, 41), packed, 70)


def test_stream_kernels_where_they_cannot_be_built_say_why(monkeypatch):
    from angelspec_hf import cpu_kernels

    monkeypatch.setattr(cpu_kernels, "_stream_extension", lambda: RuntimeError("Ninja is required to load C++ "
                                                                               "extensions\nmore"))
    assert not stream_available()
    assert stream_unavailable_reason() == "RuntimeError: Ninja is required to load C++ extensions"
    target = tiny_target()
    with pytest.raises(RuntimeError, match="could not be built on this machine .*Ninja is required.*--linear-kernels"):
        use_linear_kernels("stream", target)
    assert not is_prepacked(target)
    by_hand = PrepackedLinear.from_linear(nn.Linear(24, 40), "stream")
    with torch.no_grad(), pytest.raises(RuntimeError, match="could not be built on this machine .*Ninja is required"):
        by_hand(torch.randn(4, 24))


@pytest.mark.parametrize("library", ["onednn", pytest.param("stream", marks=needs_stream)])
def test_prepacking_keeps_the_parameters_and_follows_their_changes(library):
    target = tiny_target()
    target.config.tie_word_embeddings = True
    target.tie_weights()
    before = {k: v.clone() for k, v in target.state_dict().items()}
    lm_head = target.lm_head.weight
    count = prepack_linears(target, library)
    assert count == 4 * 7 + 1 and prepack_linears(target, library) == 0  # idempotent
    assert is_prepacked(target) and isinstance(target.lm_head, PrepackedLinear)
    assert target.lm_head.weight is lm_head is target.model.embed_tokens.weight  # still tied, nothing copied
    after = target.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(before[k], after[k]) for k in before)
    ids = torch.tensor([[5, 6, 7, 8]])  # 4 rows: inside the streaming kernel's window
    with torch.no_grad():
        logits = target(ids).logits
        target.model.layers[0].mlp.down_proj.weight.mul_(3.0)  # an in-place change: the packed copy is made again
        changed = target(ids).logits
        with stock_linears(target):
            assert not is_prepacked(target)
            stock = target(ids).logits
    assert is_prepacked(target)
    assert not torch.allclose(logits, changed, atol=1e-3) and torch.allclose(changed, stock, atol=1e-4)


@pytest.mark.parametrize("library", ["onednn", pytest.param("mkl", marks=needs_mkl),
                                     pytest.param("stream", marks=needs_stream)])
def test_a_trained_bias_beside_a_frozen_weight_gets_its_gradient(library):
    """BitFit-style training (the weight frozen, the bias trained) takes the stock kernel, which autograd sees: the
    bias gets the gradient `nn.Linear` gives it."""
    torch.manual_seed(0)
    linear = nn.Linear(24, 40)
    linear.weight.requires_grad_(False)
    packed = PrepackedLinear.from_linear(copy.deepcopy(linear), library)
    x = torch.randn(1, 8, 24)  # 8 rows: inside every packed kernel's window
    packed(x).square().sum().backward()
    linear(x).square().sum().backward()
    assert packed.bias.grad is not None and torch.allclose(packed.bias.grad, linear.bias.grad)


def test_a_prepacked_model_still_trains_copies_and_pickles():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 9), nn.Tanh(), nn.Linear(9, 2))
    reference = copy.deepcopy(model)
    prepack_linears(model)
    x = torch.randn(4, 6)
    with torch.no_grad():
        model(x)  # packs
    model(x).square().sum().backward()  # autograd takes the stock path
    reference(x).square().sum().backward()
    assert all(torch.allclose(a.grad, b.grad) for a, b in zip(model.parameters(), reference.parameters()))
    twin = copy.deepcopy(model)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    with torch.no_grad():
        assert torch.allclose(twin(x), model(x))


def test_linear_kernels_choice():
    target = tiny_target()
    assert use_linear_kernels("stock", target).startswith("stock") and not is_prepacked(target)
    assert use_linear_kernels("prepacked", target, None, object()) == "oneDNN prepacked (29 linears)"
    assert use_linear_kernels("prepacked", target) == "oneDNN prepacked (29 linears)"  # already packed: said so
    assert use_linear_kernels("prepacked", tiny_target().to(torch.float16)) == "stock (no fp32 CPU linears to prepack)"
    with pytest.raises(ValueError, match="auto"):
        use_linear_kernels("fast", target)


@pytest.mark.skipif(not prepack_available(), reason="this PyTorch has no oneDNN")
def test_auto_linear_kernels_keep_whichever_the_target_runs_faster(monkeypatch):
    """`--linear-kernels auto` times the target's plain step and 8-token verify on both kernels and keeps the faster
    (prepacked only by a margin: a near tie keeps stock); the drafters follow. Timings are forced here (which one is
    faster depends on the CPU), then measured for real."""
    from angelspec_hf import cpu_kernels

    for packed_faster, slower in ((True, 0.02), (False, 0.02), (False, -0.001)):  # -0.001: prepacked 1% faster
        def fake(model, tokens=(1, 8), **kwargs):
            packed = is_prepacked(model)
            return {k: 0.04 + (0.0 if packed == packed_faster else slower) for k in tokens}

        monkeypatch.setattr(cpu_kernels, "time_forwards", fake)
        target, drafter = tiny_target(), tiny_drafter("dfly", tiny_target())
        line = use_linear_kernels("auto", target, drafter, None)
        assert line.startswith("auto: oneDNN prepacked" if packed_faster else "auto: stock"), line
        assert is_prepacked(target) == is_prepacked(drafter) == packed_faster
        assert use_linear_kernels("auto", target, drafter) == line  # asked again, whatever it chose before
    if mkl_pack_available():  # MKL's packed verify is never auto's choice, however fast (it did not pay end to end)
        def fake_mkl(model, tokens=(1, 8), **kwargs):
            return {k: 0.001 if is_prepacked(model, "mkl") else 0.04 for k in tokens}

        monkeypatch.setattr(cpu_kernels, "time_forwards", fake_mkl)
        target = tiny_target()
        line = use_linear_kernels("auto", target)
        assert line.startswith("auto: stock") and "MKL" not in line and not is_prepacked(target), line
        monkeypatch.setattr(cpu_kernels, "time_forwards", fake)
    if stream_available():  # the weight-streaming kernel is, where it is the fastest; the drafter follows
        def fake_stream(model, tokens=(1, 8), **kwargs):
            return {k: 0.02 if is_prepacked(model, "stream") else 0.04 for k in tokens}

        monkeypatch.setattr(cpu_kernels, "time_forwards", fake_stream)
        target, drafter = tiny_target(), tiny_drafter("dfly", tiny_target())
        line = use_linear_kernels("auto", target, drafter)
        assert line.startswith("auto: weight-streaming kernel") and "ms weight-streaming" in line, line
        assert is_prepacked(target, "stream") and is_prepacked(drafter, "stream")
        monkeypatch.setattr(cpu_kernels, "time_forwards", fake)
    target = tiny_target()
    use_linear_kernels("prepacked", target)
    with torch.no_grad():
        target(torch.tensor([[3, 4, 5]]))
    assert all(m._packed is not None for m in target.modules() if isinstance(m, PrepackedLinear))  # copies made
    line = use_linear_kernels("auto", target)  # forced: stock is faster
    packed = [m for m in target.modules() if isinstance(m, PrepackedLinear)]
    assert line.startswith("auto: stock") and all(not m.enabled and m._packed is None for m in packed)  # memory back
    monkeypatch.undo()
    target = tiny_target()
    line = use_linear_kernels("auto", target)
    assert line.startswith("auto: stock") != is_prepacked(target) and "ms prepacked" in line, line
    assert use_linear_kernels("prepacked", target).startswith("oneDNN prepacked") and is_prepacked(target)


def test_prepacked_models_get_their_own_cost_profiles():
    from angelspec_hf.policy import hardware_key

    target = tiny_target()
    drafter = tiny_drafter("dfly", target)
    stock_key = hardware_key(target, drafter)
    prepack_linears(target)
    packed_key = hardware_key(target, drafter)
    with stock_linears(target):
        assert hardware_key(target, drafter) == stock_key  # unchanged for stock models: their cached files still apply
    prepack_linears(drafter)
    both_key = hardware_key(target, drafter)
    assert len({stock_key, packed_key, both_key}) == 3
    keys = {stock_key, packed_key, both_key}
    for library, available in (("mkl", mkl_pack_available()), ("stream", stream_available())):
        if available:
            prepack_linears(target, library)
            prepack_linears(drafter, library)
            keys.add(hardware_key(target, drafter))
            assert len(keys) == 3 + (library == "stream") + mkl_pack_available()


def test_a_pruned_draft_head_of_a_prepacked_target_is_prepacked_too():
    """The pruned draft head gathers rows of the target's head: when that head is prepacked, so are the rows (same
    logits to rounding, -inf outside the subset), and a stock head gets a stock pruned head."""
    target = tiny_target()
    drafter = tiny_drafter("dfly", target)
    drafter.set_draft_vocab(list(range(3, 60, 2)))
    stock_head = drafter.draft_lm_head(target.lm_head)
    prepack_linears(target)
    head = drafter.draft_lm_head(target.lm_head)
    assert head is not stock_head and head.pack and not stock_head.pack
    hidden = torch.randn(3, 2, target.config.hidden_size)
    with torch.no_grad():
        packed, ref = head(hidden), stock_head(hidden)
    assert head.packed is not None  # the oneDNN path ran
    kept = drafter.draft_vocab_ids
    assert torch.isneginf(packed[..., [i for i in range(packed.shape[-1]) if i not in kept.tolist()]]).all()
    torch.testing.assert_close(packed[..., kept], ref[..., kept], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(copy.deepcopy(head)(hidden), packed, atol=0, rtol=0)  # copies pack again
    with stock_linears(target):
        assert not drafter.draft_lm_head(target.lm_head).pack


@pytest.mark.parametrize("library", ["onednn", pytest.param("mkl", marks=needs_mkl),
                                     pytest.param("stream", marks=needs_stream)])
@pytest.mark.parametrize("family", ["mtp", "dflash", "dfly"])
def test_speculation_on_a_prepacked_target_is_lossless(family, library):
    """Target and drafter prepacked (oneDNN, or MKL or the weight-streaming kernel for the multi-token forwards):
    greedy speculative output equals the packed target's own greedy output, through the `generate()` hook and the
    batched engine."""
    from angelspec_hf.tgi_patch.engine import generate_batch

    target = tiny_target()
    drafter = tiny_drafter(family, target)
    prepack_linears(target, library)
    prepack_linears(drafter, library)
    prompts = [[5, 6, 7], [9] * 12, [4, 3, 8, 8, 1, 7]]
    outputs = generate_batch(target, drafter, prompts, max_new_tokens=20, verify=4)
    packed = [m for model in (target, drafter) for m in model.modules() if isinstance(m, PrepackedLinear)]
    if library == "onednn":
        assert all(m._packed is not None for m in packed)  # the engine's forwards ran on the packed weights
    plain = [target.generate(torch.tensor([p]), max_new_tokens=20, do_sample=False) for p in prompts]
    for p, ref in zip(prompts, plain):
        out = target.generate(torch.tensor([p]), max_new_tokens=20, do_sample=False, assistant_model=drafter)
        assert torch.equal(out, ref)
    assert drafter.last_speculation_stats.accepted  # rounds were drafted and verified
    # MKL and the streaming kernel pack a weight when a forward of 6 to 12 (3 to 48) rows first runs: prefills at least
    assert all(m._packed is not None for m in target.modules() if isinstance(m, PrepackedLinear))
    assert outputs == [ref[0, len(p):].tolist() for p, ref in zip(prompts, plain)]
