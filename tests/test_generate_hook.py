"""`target.generate(assistant_model=drafter)`: lossless greedy output, usual generate features, clear errors."""

import inspect

import pytest
import torch
from transformers import TextStreamer
from transformers.generation import GenerationMixin

from angelspec_hf import DFlashDrafter
from angelspec_hf.modeling.draft_policy import DraftLengthPolicy
from angelspec_hf.policy import RoundCosts, hardware_key
from helpers import tiny_drafter, tiny_target


def _greedy(model, ids, **kwargs):
    return model.generate(ids, do_sample=False, eos_token_id=None, pad_token_id=0, **kwargs)


def test_greedy_identity_many_prompts(target, family):
    drafter = tiny_drafter(family, target)
    gen = torch.Generator().manual_seed(7)
    accepted = 0
    for trial in range(12):
        length = int(torch.randint(1, 40, (1,), generator=gen))
        ids = torch.randint(3, 99, (1, length), generator=gen)
        new = int(torch.randint(1, 48, (1,), generator=gen))
        ref = _greedy(target, ids, max_new_tokens=new)
        out = _greedy(target, ids, max_new_tokens=new, assistant_model=drafter)
        assert torch.equal(ref, out), f"{family} diverged on trial {trial} (prompt {length}, new {new})"
        accepted += sum(drafter.last_speculation_stats.accepted)
    assert accepted > 0, "no draft token was ever accepted: the acceptance path went untested"


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_greedy_identity_both_attention_backends(family, attn):
    target = tiny_target(attn_implementation=attn, seed=3)
    drafter = tiny_drafter(family, target)
    drafter.set_attn_implementation(attn)
    ids = torch.randint(3, 99, (1, 9), generator=torch.Generator().manual_seed(1))
    assert torch.equal(_greedy(target, ids, max_new_tokens=40), _greedy(target, ids, max_new_tokens=40, assistant_model=drafter))


def test_eos_and_return_dict(target, family):
    drafter = tiny_drafter(family, target)
    ids = torch.randint(3, 99, (1, 6), generator=torch.Generator().manual_seed(5))
    plain = _greedy(target, ids, max_new_tokens=30)
    eos = int(plain[0, ids.shape[1] + 7])  # a token the target really emits mid-way
    kwargs = dict(max_new_tokens=30, do_sample=False, eos_token_id=eos, pad_token_id=0)
    ref = target.generate(ids, **kwargs, return_dict_in_generate=True, output_scores=True)
    out = target.generate(ids, **kwargs, assistant_model=drafter, return_dict_in_generate=True, output_scores=True)
    assert torch.equal(ref.sequences, out.sequences)
    assert int(out.sequences[0, -1]) == eos and out.sequences.shape[1] < ids.shape[1] + 30
    assert len(out.scores) == len(ref.scores) == out.sequences.shape[1] - ids.shape[1]
    for a, b in zip(ref.scores, out.scores):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_streamer_receives_every_token(target, family):
    class Collect(TextStreamer):
        def __init__(self):
            self.chunks = []

        def put(self, value):
            self.chunks.append(value.reshape(-1).tolist())

        def end(self):
            self.chunks.append("end")

    drafter = tiny_drafter(family, target)
    ids = torch.randint(3, 99, (1, 8), generator=torch.Generator().manual_seed(2))
    streamer = Collect()
    out = _greedy(target, ids, max_new_tokens=25, assistant_model=drafter, streamer=streamer)
    assert streamer.chunks[-1] == "end"
    streamed = [t for chunk in streamer.chunks[:-1] for t in chunk]
    assert streamed == out[0].tolist()  # the prompt first, then every accepted token once


def test_batch_over_one_names_the_batched_api(target, family):
    drafter = tiny_drafter(family, target)
    ids = torch.randint(3, 99, (2, 5))
    with pytest.raises(ValueError, match="generate_batch") as error:
        _greedy(target, ids, max_new_tokens=5, assistant_model=drafter)
    import re

    from angelspec_hf.tgi_patch.engine import generate_batch

    call = re.search(r"generate_batch\(([^)]*)\)", str(error.value)).group(1)
    named = re.findall(r"(\w+)=", call)  # the keyword the message tells users to pass exists
    assert named and set(named) <= set(inspect.signature(generate_batch).parameters)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"vocab_size": 98}, "vocab_size 98 does not match the target's vocab_size 99"),
        ({"hidden_size": 48, "head_dim": 12}, "hidden_size 48 does not match the target's hidden_size 32"),
        ({"target_layer_ids": [1, 5], "num_target_layers": None}, r"reach layer 5, but the target has only 4 layers"),
    ],
)
def test_mismatched_drafter_and_target(target, change, message):
    drafter = DFlashDrafter.from_target(target, block_size=4, **change)
    with pytest.raises(ValueError, match=message):
        _greedy(target, torch.tensor([[5, 6, 7]]), max_new_tokens=4, assistant_model=drafter)


def test_other_assistants_untouched(target):
    """The hook only routes AngelSpec drafters; transformers' own paths still run (here prompt lookup)."""
    tiny_drafter("mtp", target)  # installs the hook
    ids = torch.tensor([[5, 6, 7, 5, 6, 7, 5, 6]])
    assert torch.equal(_greedy(target, ids, max_new_tokens=12), _greedy(target, ids, max_new_tokens=12, prompt_lookup_num_tokens=3))


def test_transformers_builtin_dflash_path_runs_our_drafter(target):
    drafter = tiny_drafter("dflash", target)
    gen = torch.Generator().manual_seed(11)
    for _ in range(4):
        ids = torch.randint(3, 99, (1, int(torch.randint(2, 20, (1,), generator=gen))), generator=gen)
        ref = _greedy(target, ids, max_new_tokens=30)
        out = _greedy(target, ids, max_new_tokens=30, assistant_model=drafter, speculation_type="dflash")
        assert torch.equal(ref, out)


def test_builtin_dflash_path_refuses_dfly(target):
    with pytest.raises(ValueError, match="speculation_type='dflash'"):
        _greedy(target, torch.tensor([[5, 6]]), max_new_tokens=3, assistant_model=tiny_drafter("dfly", target),
                speculation_type="dflash")


def test_hooked_transformers_signatures(target):
    """The two private methods the hook wraps still take the arguments it reads (fails on a transformers change)."""
    tiny_drafter("mtp", target)  # installs the hook
    get = inspect.signature(GenerationMixin._get_candidate_generator.__wrapped__).parameters
    validate = inspect.signature(GenerationMixin._validate_generation_mode.__wrapped__).parameters
    assert {"generation_config", "input_ids", "logits_processor", "assistant_model"} <= set(get)
    assert {"generation_config", "generation_mode_kwargs"} <= set(validate)


@pytest.mark.parametrize("family", ["mtp", "mtp_eagle3", "dflash", "dfly"])
def test_confidence_cut_drafts_fewer_tokens_and_stays_lossless(target, family):
    """`draft_stop_threshold` ends a round's draft once the drafter's own probability of it is low: rounds get shorter
    (a near-1 threshold drafts exactly one token per round), and the output is still the target's."""
    drafter = tiny_drafter(family, target)
    generator = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 99, (1, n), generator=generator) for n in (3, 9, 17)]
    rounds = {}
    for threshold in (0.0, 0.3, 0.999):
        drafter.config.draft_stop_threshold = threshold
        proposed = []
        for ids in prompts:
            plain = target.generate(ids, max_new_tokens=20, do_sample=False, pad_token_id=0)
            spec = target.generate(ids, max_new_tokens=20, do_sample=False, pad_token_id=0, assistant_model=drafter)
            assert torch.equal(plain, spec)
            proposed += drafter.last_speculation_stats.proposed
        rounds[threshold] = proposed
    drafter.config.draft_stop_threshold = 0.0
    full = drafter.num_draft_tokens
    assert max(rounds[0.0]) == full and set(rounds[0.999]) == {1}
    assert sum(rounds[0.3]) / len(rounds[0.3]) < sum(rounds[0.0]) / len(rounds[0.0])


def test_corpus_lookup_rounds_are_lossless(target, family):
    """`drafter.lookup_corpus`: rounds verifying a lookup in a corpus of the target's own earlier replies (the first
    16 tokens of its replies to these prompts, and replies to other prompts), beside n-gram lookups and drafter
    rounds; they are taken, accepted, and the output is plain greedy decoding's."""
    from angelspec_hf.policy import CorpusIndex

    drafter = tiny_drafter(family, target, draft_length="auto", lookup_tokens=6)
    costs = RoundCosts((0.02, 0.001), (0.0, 0.001))  # fixed costs (verifying is cheap), not this machine's timing
    drafter._draft_policies = {hardware_key(target, drafter): DraftLengthPolicy(costs, drafter.num_draft_tokens,
                                                                                measure=False)}
    gen = torch.Generator().manual_seed(12)
    prompts = [torch.randint(3, 99, (1, 5), generator=gen) for _ in range(8)]
    replies = [_greedy(target, ids, max_new_tokens=32)[0, ids.shape[1]:] for ids in prompts]
    drafter.lookup_corpus = CorpusIndex([r[:16] for r in replies[:4]] + replies[4:6])
    corpus = accepted = 0
    for ids, reply in zip(prompts, replies):
        out = _greedy(target, ids, max_new_tokens=32, assistant_model=drafter)
        assert torch.equal(out[0, ids.shape[1]:], reply), f"{family} with corpus lookups diverged"
        stats = drafter.last_speculation_stats
        corpus += stats.corpus_rounds
        accepted += sum(stats.accepted)
    assert corpus > 0 and accepted > 0
    drafter.config.lookup_tokens = 0  # lookups off: the corpus is not read either
    _greedy(target, prompts[0], max_new_tokens=32, assistant_model=drafter)
    assert drafter.last_speculation_stats.corpus_rounds == 0


def test_growing_corpus_learns_greedy_replies(target, family):
    """`drafter.lookup_corpus = GrowingCorpus(...)`: each greedy call's prompt tail and reply join the window when the
    call returns, so the same prompts sent again are proposed their earlier replies (corpus rounds, more tokens
    accepted per round); every output stays plain greedy decoding's, and a sampled call adds nothing."""
    from angelspec_hf.policy import GrowingCorpus

    drafter = tiny_drafter(family, target, draft_length="auto", lookup_tokens=6)
    costs = RoundCosts((0.02, 0.001), (0.0, 0.001))  # fixed costs (verifying is cheap), not this machine's timing
    drafter._draft_policies = {hardware_key(target, drafter): DraftLengthPolicy(costs, drafter.num_draft_tokens,
                                                                                measure=False)}
    drafter.lookup_corpus = corpus = GrowingCorpus(None, 4096)
    gen = torch.Generator().manual_seed(21)
    prompts = [torch.randint(3, 99, (1, 6), generator=gen) for _ in range(4)]
    replies = [_greedy(target, ids, max_new_tokens=32)[0, ids.shape[1]:] for ids in prompts]
    rounds, taus = [], []
    for sent in range(2):
        for i, (ids, reply) in enumerate(zip(prompts, replies)):
            out = _greedy(target, ids, max_new_tokens=32, assistant_model=drafter)
            assert torch.equal(out[0, ids.shape[1]:], reply), f"{family} with a growing corpus diverged"
            assert corpus.added == sent * len(prompts) + i + 1  # added as the call returned
            stats = drafter.last_speculation_stats
            rounds.append(stats.corpus_rounds)
            taus.append(stats.mean_accepted_length)
    first, again = slice(0, len(prompts)), slice(len(prompts), None)
    assert all(rounds[again]), f"a prompt sent again was not proposed its earlier reply: {rounds}"
    assert sum(taus[again]) > sum(taus[first]), f"no more accepted per round the second time: {taus}"
    target.generate(prompts[0], do_sample=True, max_new_tokens=8, eos_token_id=None, pad_token_id=0,
                    assistant_model=drafter)
    assert corpus.added == 2 * len(prompts), "a sampled reply joined the corpus"


@pytest.mark.parametrize("draft_length", ["auto", "full"])
def test_ngram_lookup_rounds_are_lossless(target, family, draft_length):
    """`lookup_tokens`: rounds verifying an n-gram lookup beside drafter rounds; prompts that repeat themselves, so
    lookups are on offer and some are accepted."""
    drafter = tiny_drafter(family, target, draft_length=draft_length, lookup_tokens=6, lookup_max_ngram=2)
    if draft_length == "auto":  # fixed round costs (verifying is cheap), not this machine's timing under load: the
        # lookups this test needs are then on offer whatever else the machine runs
        costs = RoundCosts((0.02, 0.001), (0.0, 0.001))
        drafter._draft_policies = {hardware_key(target, drafter): DraftLengthPolicy(costs, drafter.num_draft_tokens,
                                                                                    measure=False)}
    gen = torch.Generator().manual_seed(11)
    lookups = accepted = 0
    for trial in range(6):
        motif = torch.randint(3, 99, (1, int(torch.randint(2, 6, (1,), generator=gen))), generator=gen)
        ids = motif.repeat(1, 4)
        ref = _greedy(target, ids, max_new_tokens=32)
        out = _greedy(target, ids, max_new_tokens=32, assistant_model=drafter)
        assert torch.equal(ref, out), f"{family} with lookups diverged on trial {trial}"
        stats = drafter.last_speculation_stats
        lookups += stats.lookup_rounds
        accepted += sum(stats.accepted)
    assert lookups > 0 and accepted > 0
