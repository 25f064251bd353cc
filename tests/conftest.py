"""Tiny odd-sized random targets and drafters of every family, for fast equivalence tests."""

import os
import shutil

# Triton kernels run under Triton's interpreter where there is no GPU. It must be set before anything imports triton
# (transformers may), since triton's own library functions (tl.sort, ...) are defined at its import.
if shutil.which("nvidia-smi") is None:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

import angelspec_hf  # noqa: F401  (registers the Auto classes)
from angelspec_hf import DFlashDrafter, DFlyDrafter, MTPDrafter

FAMILIES = {
    "mtp": (MTPDrafter, {"num_draft_tokens": 3}),
    "mtp_eagle3": (MTPDrafter, {"num_draft_tokens": 3, "layout": "eagle3"}),  # EAGLE-3's architecture (vLLM, SGLang)
    "dflash": (DFlashDrafter, {"block_size": 4}),
    "dfly": (DFlyDrafter, {"block_size": 5}),
}


def tiny_target(vocab_size=99, seed=0, attn_implementation="eager", skew=6.0):
    """A random 4-layer Llama. `skew` scales three LM-head rows so that target and (random) drafters often agree,
    which makes drafts get accepted and exercises the acceptance path."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab_size, hidden_size=32, intermediate_size=37, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        attn_implementation=attn_implementation,
    )
    target = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        target.lm_head.weight[3:6] *= skew
    return target


def tiny_chat_target(seed=0, favour=8.0):
    """A tiny random Llama with the embedded target's real tokenizer (vocabulary 49,152 and chat template), for
    training tests; a few favoured tokens (LM-head rows scaled by `favour`) make its replies learnable in a few dozen
    steps; `favour=1` leaves it unskewed (varied replies)."""
    from transformers import AutoTokenizer

    from angelspec_hf.targets import GGUF_FILE, default_target_path

    tokenizer = AutoTokenizer.from_pretrained(default_target_path(), gguf_file=GGUF_FILE)
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=37, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, eos_token_id=2, pad_token_id=2)
    target = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        target.lm_head.weight[3:6] *= favour
    return target, tokenizer


def tiny_drafter(family, target, seed=1, **overrides):
    """A random drafter of `family` for `target`. It drafts whole blocks (`draft_length="full"`) unless told
    otherwise, so tests exercise drafting and verification every round whatever the timing of this machine."""
    cls, defaults = FAMILIES[family]
    torch.manual_seed(seed)
    drafter = cls.from_target(target, **(defaults | {"draft_length": "full"} | overrides)).eval()
    if family == "dfly":  # a trained-looking AR head (it starts at zero, which would make it a no-op)
        with torch.no_grad():
            drafter.ar_head.down_proj.weight.normal_(std=0.2)
            drafter.layer_fusion_weights.normal_()
    return drafter


@pytest.fixture(autouse=True)
def one_thread_for_tiny_models(request):
    """Tiny models gain nothing from intra-op threads, and on a busy 2-core machine threads cost them up to 10x;
    tests on the real target (marked `real_model`) keep the default."""
    if request.node.get_closest_marker("real_model"):
        yield
        return
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def target():
    return tiny_target()


@pytest.fixture(params=sorted(FAMILIES))
def family(request):
    return request.param
