"""The lossless invariant on the real embedded target (SmolLM2-135M-Instruct), with prompts from ../shared/data.

The drafters here are untrained (trained ones come with the training issue), so this checks correctness on the real
architecture, chat template and vocabulary, not speed."""

import pytest
import torch

import angelspec_hf
from angelspec_hf import DFlashDrafter, DFlyDrafter, MTPDrafter
from angelspec_hf.prompts import chat_input_ids, load_eval_prompts
from helpers import cores_per_worker

pytestmark = pytest.mark.real_model
NEW_TOKENS = 24


@pytest.fixture(scope="module")
def real():
    torch.set_num_threads(cores_per_worker())
    target, tokenizer = angelspec_hf.load_default_target()
    prompts = (load_eval_prompts("mt_bench", 4) + load_eval_prompts("humaneval", 3) + load_eval_prompts("gsm8k", 3))
    inputs = [chat_input_ids(tokenizer, p) for p in prompts]
    plain = [target.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False) for ids in inputs]
    return target, tokenizer, inputs, plain


def test_default_target_is_the_embedded_smollm2(real):
    target, tokenizer, _, plain = real
    c = target.config
    assert (type(target).__name__, c.num_hidden_layers, c.hidden_size, c.vocab_size) == ("LlamaForCausalLM", 30, 576, 49152)
    assert (target.device.type, target.dtype) == ("cpu", torch.float32)  # the loaders' default, as from_pretrained's
    text = tokenizer.decode(plain[4][0], skip_special_tokens=True)  # a HumanEval prompt: the reply should be code
    assert "def " in text


def test_the_cached_embedded_target_is_the_gguf(tmp_path, monkeypatch):
    """The first load converts the GGUF and keeps an HF folder; loads from it give the same weights, config,
    generation config and tokenizer (ids, specials, chat template) as the GGUF did."""
    from angelspec_hf.targets import converted_target_dir, default_target_path, load_default_tokenizer

    monkeypatch.setenv("ANGELSPEC_CACHE", str(tmp_path))
    folder = converted_target_dir(default_target_path())
    assert not folder.exists()
    gguf_model, gguf_tok = angelspec_hf.load_default_target()  # from the GGUF: writes the folder
    assert (folder / "model.safetensors").is_file() and not list(folder.parent.glob("*.tmp-*"))
    model, tok = angelspec_hf.load_default_target()
    a, b = gguf_model.state_dict(), model.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    skip = {"_name_or_path", "transformers_version", "quantization_config"}  # the GGUF quantizer's mark
    assert {k: v for k, v in gguf_model.config.to_dict().items() if k not in skip} == \
        {k: v for k, v in model.config.to_dict().items() if k not in skip}
    assert gguf_model.generation_config.to_diff_dict() == model.generation_config.to_diff_dict()
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "def f(x):\n    return x  # é, 日本"}]
    for tokenizer in (tok, load_default_tokenizer()):
        assert len(tokenizer) == len(gguf_tok) and tokenizer.all_special_ids == gguf_tok.all_special_ids
        assert tokenizer.chat_template == gguf_tok.chat_template
        for text in ["Hello world", "  x = [1, 2]\n\tprint(x)", "<|im_start|>user\nhi<|im_end|>", "日本語 é"]:
            assert tokenizer(text).input_ids == gguf_tok(text).input_ids
        assert tokenizer.apply_chat_template(chat, add_generation_prompt=True) == \
            gguf_tok.apply_chat_template(chat, add_generation_prompt=True)


@pytest.mark.parametrize("index,cls", list(enumerate([MTPDrafter, DFlashDrafter, DFlyDrafter])))
def test_greedy_identity_on_real_prompts(real, index, cls):
    """Every family, whole blocks drafted and verified every round, on a third of the prompts each (chat, code and
    math for every family; all ten prompts across the three)."""
    target, _, inputs, plain = real
    torch.manual_seed(0)
    drafter = cls.from_target(target, draft_length="full").eval()
    for ids, ref in list(zip(inputs, plain))[index::3]:
        out = target.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, assistant_model=drafter)
        assert torch.equal(out, ref)


def test_transformers_dflash_path_on_real_target(real):
    target, _, inputs, plain = real
    drafter = DFlashDrafter.from_target(target).eval()
    for ids, ref in list(zip(inputs, plain))[:3]:
        out = target.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, assistant_model=drafter,
                              speculation_type="dflash")
        assert torch.equal(out, ref)


@pytest.mark.parametrize("family,verify", [("dfly", 6), ("mtp", "depth:3")])
def test_batched_engine_is_lossless_on_real_prompts(real, family, verify):
    """All 10 prompts at once through the continuous-batching engine (shipped drafter where there is one, and at most
    4 requests running so that requests join as others leave): each output equals its own plain greedy output."""
    from angelspec_hf.shipped import shipped_or_untrained
    from angelspec_hf.tgi_patch.engine import generate_batch

    target, _, inputs, plain = real
    torch.manual_seed(0)
    drafter, _ = shipped_or_untrained(family, target)
    outputs = generate_batch(target, drafter, [ids[0].tolist() for ids in inputs], max_new_tokens=NEW_TOKENS,
                             verify=verify, max_batch_size=4)
    for ids, ref, out in zip(inputs, plain, outputs):
        assert out == ref[0, ids.shape[1]:].tolist()


def test_prepacked_real_target_with_the_shipped_dfly_is_lossless(real):
    """`--linear-kernels prepacked` (what `auto` picks where it is faster): the real target and the shipped DFly on
    oneDNN-prepacked weights. Speculative output equals the prepacked target's own greedy output on all ten prompts, through the
    `generate()` hook (whole blocks) and the batched engine."""
    import copy

    from angelspec_hf.cpu_kernels import prepack_linears
    from angelspec_hf.shipped import shipped_or_untrained
    from angelspec_hf.tgi_patch.engine import generate_batch

    target = copy.deepcopy(real[0])
    _, _, inputs, _ = real
    drafter, trained = shipped_or_untrained("dfly", target)
    drafter.config.draft_length = "full"
    assert trained and prepack_linears(target) == 30 * 7 + 1 and prepack_linears(drafter) > 0
    plain = [target.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False) for ids in inputs]
    for ids, ref in zip(inputs, plain):
        assert torch.equal(target.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, assistant_model=drafter),
                           ref)
    outputs = generate_batch(target, drafter, [ids[0].tolist() for ids in inputs], max_new_tokens=NEW_TOKENS,
                             verify=6, max_batch_size=4)
    assert outputs == [ref[0, ids.shape[1]:].tolist() for ids, ref in zip(inputs, plain)]


@pytest.mark.parametrize("family,prompt_index", [("dfly", 4), ("dflash", 7), ("mtp", 0)])
def test_shipped_drafters(real, family, prompt_index):
    """The drafters in drafters/ load (fp16 on disk, the target's dtype in use), fit the target, keep greedy output
    identical, and — unlike an untrained drafter — really get drafts accepted on a prompt of their domain."""
    from safetensors import safe_open

    from angelspec_hf.shipped import shipped_drafter_path, shipped_or_untrained

    target, _, inputs, plain = real
    path = shipped_drafter_path(family)
    assert path is not None, f"no shipped {family} drafter in drafters/"
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        dtypes = {f.get_tensor(k).dtype for k in f.keys()}
    assert {d for d in dtypes if d.is_floating_point} == {torch.float16} and dtypes <= {torch.float16, torch.int64}
    assert "τ" in (path / "README.md").read_text()  # the model card states measured acceptance
    drafter, trained = shipped_or_untrained(family, target)
    assert trained and drafter.dtype == target.dtype
    ids = inputs[prompt_index]
    for draft_length in ("auto", "full"):  # "auto" may decode plainly when drafting does not pay on this machine
        drafter.config.draft_length = draft_length
        out = target.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, assistant_model=drafter)
        assert torch.equal(out, plain[prompt_index])
    assert sum(drafter.last_speculation_stats.accepted) > 0  # whole blocks: drafts really accepted


def test_shipped_mtp_exports_to_eagle3(real, tmp_path):
    """The shipped MTP drafter is in EAGLE-3's layout: `angelspec export --format eagle3` writes what vLLM's
    Eagle3LlamaForCausalLM / SGLang's LlamaForCausalLMEagle3 load, with the pruned vocabulary as d2t / t2d."""
    import json

    from angelspec_hf.modeling.converters import export_eagle
    from angelspec_hf.shipped import shipped_or_untrained

    target = real[0]
    drafter, trained = shipped_or_untrained("mtp", target)
    assert trained and drafter.config.layout == "eagle3"
    folder = export_eagle(drafter, tmp_path / "eagle3", target)
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["draft_vocab_size"] == 8192
