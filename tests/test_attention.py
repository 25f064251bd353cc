"""`angelspec_sdpa` (angelspec_hf.attention): transformers' SDPA bit for bit, without `repeat_kv`'s copies of the KV
cache in a CPU verify forward; who switches to it."""

import pytest
import torch
import transformers.integrations.sdpa_attention as sdpa_module
from transformers import DynamicCache

import angelspec_hf
from angelspec_hf.attention import GQA_SDPA_ATTENTION, use_gqa_sdpa
from helpers import count_calls, tiny_drafter, tiny_target


def _verify_logits(model, implementation, prompt, rows, attention_mask=None, with_prefill=False):
    """Logits of a forward of `rows` new tokens after `prompt` (batch, length) is cached: a speculative verify (and
    the prefill's before them, `with_prefill`)."""
    model.set_attn_implementation(implementation)
    cache = DynamicCache(config=model.config)
    mask = None if attention_mask is None else attention_mask[:, : prompt.shape[1]]
    with torch.no_grad():
        prefill = model(input_ids=prompt, attention_mask=mask, cache=cache, use_cache=True).logits
        new = torch.randint(3, 99, (prompt.shape[0], rows), generator=torch.Generator().manual_seed(rows))
        full_mask = None if attention_mask is None else attention_mask[:, : prompt.shape[1] + rows]
        verify = model(input_ids=new, attention_mask=full_mask, cache=cache, use_cache=True).logits
    return (prefill, verify) if with_prefill else verify


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 2, 5, 12])
def test_same_logits_as_sdpa_bit_for_bit(rows, dtype):
    model = tiny_target(attn_implementation="sdpa", seed=4).to(dtype)
    prompt = torch.randint(3, 99, (1, 37), generator=torch.Generator().manual_seed(0))
    reference = _verify_logits(model, "sdpa", prompt, rows)
    assert torch.equal(_verify_logits(model, GQA_SDPA_ATTENTION, prompt, rows), reference)


def test_same_logits_with_left_padding():
    """A batch with padding (batched regeneration prefills this way): the 4-D mask carries it, per sequence, in the
    prefill and in the verify after it."""
    model = tiny_target(attn_implementation="sdpa", seed=5)
    prompt = torch.randint(3, 99, (2, 20), generator=torch.Generator().manual_seed(1))
    attention_mask = torch.ones(2, 26, dtype=torch.long)
    attention_mask[1, :7] = 0
    reference = _verify_logits(model, "sdpa", prompt, 6, attention_mask, with_prefill=True)
    ours = _verify_logits(model, GQA_SDPA_ATTENTION, prompt, 6, attention_mask, with_prefill=True)
    assert not reference[0].isnan().any()
    assert all(torch.equal(a, b) for a, b in zip(ours, reference))


def test_a_verify_forward_copies_no_keys_or_values(monkeypatch):
    """The point of it: transformers' SDPA path expands every layer's keys and values per head group (`repeat_kv`)
    in a multi-row forward under a mask; `angelspec_sdpa` hands the grouped heads to SDPA instead."""
    model = tiny_target(attn_implementation="sdpa", seed=6)
    prompt = torch.randint(3, 99, (1, 30), generator=torch.Generator().manual_seed(2))
    calls = count_calls(monkeypatch, repeat_kv=(sdpa_module, "repeat_kv"))
    _verify_logits(model, "sdpa", prompt, 4)
    assert calls["repeat_kv"] == 2 * model.config.num_hidden_layers  # what it saves: a copy of K and V per layer
    calls["repeat_kv"] = 0
    _verify_logits(model, GQA_SDPA_ATTENTION, prompt, 4)
    assert calls["repeat_kv"] == 0


def test_use_gqa_sdpa_switches_sdpa_only():
    sdpa, eager = tiny_target(attn_implementation="sdpa"), tiny_target(attn_implementation="eager")
    assert use_gqa_sdpa(sdpa) and sdpa.config._attn_implementation == GQA_SDPA_ATTENTION
    assert use_gqa_sdpa(sdpa)  # idempotent
    assert not use_gqa_sdpa(eager) and eager.config._attn_implementation == "eager"
    # and it loads by name, as any registered implementation does
    assert angelspec_hf.GQA_SDPA_ATTENTION == "angelspec_sdpa"


def test_the_generate_hook_switches_a_cpu_sdpa_target_and_stays_lossless(family):
    target = tiny_target(attn_implementation="sdpa", seed=3)
    drafter = tiny_drafter(family, target)
    ids = torch.randint(3, 99, (1, 11), generator=torch.Generator().manual_seed(3))
    kwargs = dict(do_sample=False, eos_token_id=None, pad_token_id=0, max_new_tokens=40)
    plain = target.generate(ids, **kwargs)  # transformers' own SDPA
    assert target.config._attn_implementation == "sdpa"
    assert torch.equal(target.generate(ids, assistant_model=drafter, **kwargs), plain)
    assert target.config._attn_implementation == GQA_SDPA_ATTENTION


def test_saved_folders_do_not_name_it(tmp_path):
    """A folder saved from a switched model loads anywhere, without this library."""
    model = tiny_target(attn_implementation="sdpa")
    use_gqa_sdpa(model)
    model.save_pretrained(tmp_path)
    assert GQA_SDPA_ATTENTION not in (tmp_path / "config.json").read_text()


def test_cost_profiles_of_the_two_attentions_are_kept_apart():
    """Its verify forwards cost less, so cost profiles measured under `sdpa` do not apply to it."""
    from angelspec_hf.policy import hardware_key

    model = tiny_target(attn_implementation="sdpa")
    before = hardware_key(model)
    use_gqa_sdpa(model)
    assert hardware_key(model) != before
    model.set_attn_implementation("sdpa")
    assert hardware_key(model) == before


def test_models_it_cannot_serve_keep_their_attention():
    """A model whose attention does not go through transformers' `AttentionInterface` is left on `sdpa` (and the
    hook still runs on it)."""
    model = tiny_target(attn_implementation="sdpa")
    model.is_backend_compatible = lambda: False
    assert not use_gqa_sdpa(model) and model.config._attn_implementation == "sdpa"
