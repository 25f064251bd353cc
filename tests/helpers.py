"""Helpers shared by the tests: tiny odd-sized random targets and drafters of every family (fast equivalence tests),
the served model (a tiny Llama with the real tokenizer) and a live TGI-compatible app on it. Statistical helpers are in
`stats.py`; fixtures in `conftest.py`."""

import functools
import os

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import angelspec_hf  # noqa: F401  (registers the Auto classes)
from angelspec_hf import DFlashDrafter, DFlyDrafter, MTPDrafter

FAMILIES = {
    "mtp": (MTPDrafter, {"num_draft_tokens": 3}),
    "mtp_eagle3": (MTPDrafter, {"num_draft_tokens": 3, "layout": "eagle3"}),  # EAGLE-3's architecture (vLLM, SGLang)
    "dflash": (DFlashDrafter, {"block_size": 4}),
    "dfly": (DFlyDrafter, {"block_size": 5}),
}


def cores_per_worker() -> int:
    """The cores one test process may use: all of them, or its share under `pytest -n N` (pytest-xdist)."""
    return max(1, (os.cpu_count() or 1) // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))


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

    from angelspec_hf.targets import load_default_tokenizer

    tokenizer = load_default_tokenizer()
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


def greedy_select(logits, j):
    return logits.argmax(-1), logits.float(), None


def features_for(drafter, length, seed=0):
    """Random target features `[1, length, layers · hidden]` for `drafter` and `length + 1` token ids below 99."""
    g = torch.Generator().manual_seed(seed)
    width = len(drafter.config.target_layer_ids) * drafter.config.hidden_size
    return torch.randn(1, length, width, generator=g), torch.randint(3, 99, (1, length + 1), generator=g)


def propose(drafter, target, state, features, ids, num_tokens=None):
    return drafter.propose(
        state, context_hidden_states=features, input_ids=ids,
        num_tokens=drafter.num_draft_tokens if num_tokens is None else num_tokens,
        embed_tokens=target.get_input_embeddings(), lm_head=target.get_output_embeddings(), select=greedy_select,
    )


def same_drafts(a, b, target):
    """Whether drafters `a` and `b` draft the same tokens with the same scores from the same features."""
    features, ids = features_for(a, 8, seed=9)
    pa = propose(a, target, a.new_draft_state(), features, ids)
    pb = propose(b, target, b.new_draft_state(), features, ids)
    return torch.equal(pa[0], pb[0]) and torch.allclose(pa[1], pb[1], atol=1e-6)


@functools.lru_cache(maxsize=None)
def served_target():
    """What the protocol, client and server tests serve: a tiny random Llama with the embedded target's real tokenizer
    and chat template (the real vocabulary, special tokens and byte-level detokenisation; none of the 135M model's
    cost). A few common words are favoured (LM-head rows doubled): it writes varied text that repeats itself now and then,
    so the penalties the clients send change its greedy choice."""
    torch.set_num_threads(1)
    target, tokenizer = tiny_chat_target(seed=0, favour=1.0)
    words = tokenizer(" the and of a to in is it that for", add_special_tokens=False).input_ids
    with torch.no_grad():
        target.lm_head.weight[words] *= 2.0
    target.generation_config.eos_token_id = tokenizer.eos_token_id
    return target, tokenizer


def reference(input_ids, max_new_tokens):
    """The served model's own greedy tokens: what the server must return, token for token."""
    target, _ = served_target()
    out = target.generate(torch.tensor([input_ids]), max_new_tokens=max_new_tokens, do_sample=False)
    return out[0, len(input_ids):].tolist()


MODEL_ID = "SmolLM2-135M-Instruct"
# A fixed cost model (seconds per step, roughly this CPU) instead of profiling one at start-up: D-Cut still chooses.
SERVER_COST = dict(verify_coef=(0.06, 0.002, 0.004), draft_coef=(0.02, 0.003))


def make_app(drafter=True, **kwargs):
    """The TGI-compatible app on `served_target()` with the batched engine (an untrained DFly drafter: correctness,
    not speed) and a fixed cost model; returns `(app, engine)`."""
    from angelspec_hf.policy import CostModel
    from angelspec_hf.tgi_patch.engine import SpeculativeEngine
    from angelspec_hf.tgi_patch.server import create_app

    target, tokenizer = served_target()
    draft_model = DFlyDrafter.from_target(target).eval() if drafter else None
    engine = SpeculativeEngine(target, draft_model, verify="auto", cost_model=CostModel(**SERVER_COST),
                               max_batch_size=8)
    limits = dict(max_input_tokens=128, max_total_tokens=384, max_concurrent_requests=6) | kwargs
    return create_app(engine, tokenizer, MODEL_ID, **limits), engine


def count_calls(monkeypatch, **targets) -> dict:
    """Wraps each `name=(module, attribute)` function so that its calls are counted: returns `{name: calls}`, kept
    up to date (e.g. to check which of a kernel and its reference a dispatch ran)."""
    calls = {name: 0 for name in targets}

    def counted(name, impl):
        def wrapper(*args, **kwargs):
            calls[name] += 1
            return impl(*args, **kwargs)
        return wrapper

    for name, (module, attribute) in targets.items():
        monkeypatch.setattr(module, attribute, counted(name, getattr(module, attribute)))
    return calls
