"""The lossless invariant on the real embedded target (SmolLM2-135M-Instruct), with prompts from ../shared/data.

The drafters here are untrained (trained ones come with the training issue), so this checks correctness on the real
architecture, chat template and vocabulary, not speed."""

import pytest
import torch

import angelspec_hf
from angelspec_hf import DFlashDrafter, DFlyDrafter, MTPDrafter
from angelspec_hf.prompts import chat_input_ids, load_eval_prompts

pytestmark = pytest.mark.real_model
NEW_TOKENS = 24


@pytest.fixture(scope="module")
def real():
    torch.set_num_threads(2)
    target, tokenizer = angelspec_hf.load_default_target()
    prompts = (load_eval_prompts("mt_bench", 4) + load_eval_prompts("humaneval", 3) + load_eval_prompts("gsm8k", 3))
    inputs = [chat_input_ids(tokenizer, p) for p in prompts]
    plain = [target.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False) for ids in inputs]
    return target, tokenizer, inputs, plain


def test_default_target_is_the_embedded_smollm2(real):
    target, tokenizer, _, plain = real
    c = target.config
    assert (type(target).__name__, c.num_hidden_layers, c.hidden_size, c.vocab_size) == ("LlamaForCausalLM", 30, 576, 49152)
    text = tokenizer.decode(plain[4][0], skip_special_tokens=True)  # a HumanEval prompt: the reply should be code
    assert "def " in text


@pytest.mark.parametrize("cls", [MTPDrafter, DFlashDrafter, DFlyDrafter])
def test_greedy_identity_on_real_prompts(real, cls):
    target, _, inputs, plain = real
    torch.manual_seed(0)
    drafter = cls.from_target(target).eval()
    for ids, ref in zip(inputs, plain):
        out = target.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, assistant_model=drafter)
        assert torch.equal(out, ref)


def test_transformers_dflash_path_on_real_target(real):
    target, _, inputs, plain = real
    drafter = DFlashDrafter.from_target(target).eval()
    for ids, ref in list(zip(inputs, plain))[:3]:
        out = target.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, assistant_model=drafter,
                              speculation_type="dflash")
        assert torch.equal(out, ref)
