"""Drafter models: configs, cached vs uncached drafting, attention backends, DFly's reduction to DFlash, and the
save / load paths (native, Auto classes, trust_remote_code without this library, Hub id from the offline cache)."""

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from transformers import AutoConfig, AutoModel, LlamaConfig

import angelspec_hf
from angelspec_hf import DFlashConfig, DFlyConfig, DFlyDrafter, MTPConfig
from angelspec_hf.modeling.dflash.configuration_dflash import evenly_spaced_layer_ids
from helpers import FAMILIES, features_for, propose, same_drafts, tiny_drafter


# ---- configs -------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "cls, kwargs, message",
    [
        (DFlashConfig, {"block_size": 1}, "block_size must be >= 2"),
        (DFlashConfig, {"vocab_size": 50, "mask_token_id": 50}, "outside the vocabulary"),
        (DFlashConfig, {"target_layer_ids": [1, 1]}, "distinct non-negative"),
        (DFlashConfig, {"target_layer_ids": [0, 9], "num_target_layers": 4}, "reach layer 9 but the target has 4"),
        (MTPConfig, {"num_draft_tokens": 0}, "num_draft_tokens must be >= 1"),
        (MTPConfig, {"target_layer_ids": [1, 2]}, "exactly one target layer"),
        (MTPConfig, {"layout": "eagle"}, "layout must be one of"),
        (MTPConfig, {"layout": "eagle3"}, "needs target_layer_ids"),
        (MTPConfig, {"layout": "eagle3", "target_layer_ids": [3, 1, 2], "num_hidden_layers": 1}, "increasing order"),
        (MTPConfig, {"layout": "eagle3", "target_layer_ids": [0, 1, 3], "num_target_layers": 4, "num_hidden_layers": 1},
         "last layer"),
        (MTPConfig, {"layout": "eagle3", "target_layer_ids": [0, 1, 2], "num_hidden_layers": 2}, "one decoder layer"),
        (DFlyConfig, {"ar_head_intermediate_size": 0}, "must be positive"),
        (DFlashConfig, {"num_attention_heads": 4, "num_key_value_heads": 3}, "multiple of"),
    ],
)
def test_config_validation(cls, kwargs, message):
    with pytest.raises(ValueError, match=message):
        base = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8)
        cls(**(base | kwargs))


def test_from_target_fits_the_target(target):
    for family, (cls, defaults) in FAMILIES.items():
        config = cls.config_class.from_target(target.config, **defaults)
        assert (config.vocab_size, config.hidden_size, config.num_target_layers) == (99, 32, 4)
        assert max(config.target_layer_ids) < 4
        assert config.num_attention_heads == 4 and config.num_key_value_heads == 2 and config.head_dim == 8
    assert MTPConfig.from_target(target.config).target_layer_ids == [3]
    assert MTPConfig.from_target(target.config, layout="eagle3").target_layer_ids == [0, 1, 2]
    assert evenly_spaced_layer_ids(36, 5) == [1, 9, 17, 25, 33]  # z-lab's choice for Qwen3-8B
    deep = LlamaConfig(num_hidden_layers=30, hidden_size=64, num_attention_heads=4, vocab_size=99)
    assert DFlashConfig.from_target(deep).target_layer_ids == [1, 10, 18, 27]
    assert DFlashConfig.from_target(deep, num_hidden_layers=5).target_layer_ids == [1, 8, 14, 20, 27]
    # vLLM's and SGLang's default EAGLE-3 capture: the inputs of layers 2, 15, 27 = the outputs of 1, 14, 26
    assert MTPConfig.from_target(deep, layout="eagle3").target_layer_ids == [1, 14, 26]


def test_drafters_do_not_store_the_target_embedding_or_head(target, family):
    state = tiny_drafter(family, target).state_dict()
    assert not [name for name, t in state.items() if target.config.vocab_size in t.shape]


# ---- drafting ------------------------------------------------------------------------------------------------------
def test_cached_drafting_equals_uncached(target, family):
    drafter = tiny_drafter(family, target)
    features, ids = features_for(drafter, 17)
    state = drafter.new_draft_state()
    for end in (5, 6, 11, 17):  # context arrives in uneven pieces, as accepted lengths vary
        start = state.context_length
        cached = propose(drafter, target, state, features[:, start:end], ids[:, : end + 1])
        fresh = propose(drafter, target, drafter.new_draft_state(), features[:, :end], ids[:, : end + 1])
        assert torch.equal(cached[0], fresh[0])
        torch.testing.assert_close(cached[1], fresh[1], rtol=1e-5, atol=1e-5)
    assert state.context_length == 17 and state.cache.get_seq_length() == 17  # nothing speculative left behind


def test_fewer_tokens_is_a_prefix(target, family):
    drafter = tiny_drafter(family, target)
    features, ids = features_for(drafter, 9, seed=3)
    full = propose(drafter, target, drafter.new_draft_state(), features, ids)
    short = propose(drafter, target, drafter.new_draft_state(), features, ids, num_tokens=2)
    assert torch.equal(short[0], full[0][:, :2])


def test_eager_equals_sdpa(target, family):
    drafter = tiny_drafter(family, target)
    features, ids = features_for(drafter, 12, seed=5)
    drafter.set_attn_implementation("eager")
    eager = propose(drafter, target, drafter.new_draft_state(), features, ids)
    drafter.set_attn_implementation("sdpa")
    sdpa = propose(drafter, target, drafter.new_draft_state(), features, ids)
    assert torch.equal(eager[0], sdpa[0])
    torch.testing.assert_close(eager[1], sdpa[1], rtol=1e-5, atol=1e-5)


def test_untrained_dfly_head_changes_nothing(target):
    """Zero-initialised AR head: DFly's sequential head gives exactly its parallel (DFlash-style) logits."""
    torch.manual_seed(0)
    with_head = DFlyDrafter.from_target(target, block_size=6).eval()
    without = DFlyDrafter.from_target(target, block_size=6, use_ar_head=False).eval()
    without.load_state_dict({k: v for k, v in with_head.state_dict().items() if not k.startswith("ar_head.")})
    assert not with_head.ar_head.down_proj.weight.any()
    features, ids = features_for(with_head, 10)
    a = propose(with_head, target, with_head.new_draft_state(), features, ids)
    b = propose(without, target, without.new_draft_state(), features, ids)
    assert torch.equal(a[0], b[0])
    torch.testing.assert_close(a[1], b[1], rtol=1e-6, atol=1e-6)
    # ...and a trained head does condition on the predecessor.
    with torch.no_grad():
        with_head.ar_head.down_proj.weight.normal_(std=0.5)
    assert not torch.equal(propose(with_head, target, with_head.new_draft_state(), features, ids)[1], b[1])


def test_dfly_layer_fusion_gives_each_layer_its_own_context(target):
    drafter = tiny_drafter("dfly", target, num_hidden_layers=2, target_layer_ids=[0, 1, 3])
    features, _ = features_for(drafter, 4)
    contexts = drafter.layer_contexts(features)
    assert len(contexts) == 2 and not torch.allclose(contexts[0], contexts[1])
    # the ablation without fusion: DFlash's one shared context, and no fusion weights to train or store
    plain = DFlyDrafter(DFlyConfig(**(drafter.config.to_dict() | {"use_layer_fusion": False})))
    plain.load_state_dict({k: v for k, v in drafter.state_dict().items() if k != "layer_fusion_weights"})
    shared = plain.layer_contexts(features)
    assert "layer_fusion_weights" not in dict(plain.named_parameters()) and torch.equal(shared[0], shared[1])
    torch.testing.assert_close(shared[0], plain.hidden_norm(plain.fc(features)))


@pytest.mark.parametrize("family", ["dflash", "dfly"])
def test_grown_drafter_drafts_what_it_did_until_trained(tmp_path, target, family):
    """`grow_layers` (warm-starting a deeper drafter): same drafts and scores, cached drafting included; the new
    layers are real layers (moving them changes the drafts), and the deeper drafter saves and loads as such."""
    drafter = tiny_drafter(family, target)
    grown = tiny_drafter(family, target)
    grown.grow_layers(4)
    assert len(grown.layers) == grown.config.num_hidden_layers == 4 and len(grown.config.layer_types) == 4
    features, ids = features_for(drafter, 13, seed=2)
    for end in (6, 13):  # context in two pieces: the new layers' caches line up too
        a = propose(drafter, target, drafter.new_draft_state(), features[:, :end], ids[:, : end + 1])
        b = propose(grown, target, grown.new_draft_state(), features[:, :end], ids[:, : end + 1])
        assert torch.equal(a[0], b[0])
        torch.testing.assert_close(a[1], b[1], rtol=1e-5, atol=1e-5)
    grown.save_pretrained(tmp_path)
    loaded = AutoModel.from_pretrained(tmp_path).eval()
    assert loaded.config.num_hidden_layers == 4 and same_drafts(grown, loaded, target)
    with torch.no_grad():
        grown.layers[3].mlp.down_proj.weight.normal_(std=0.5)
    assert not same_drafts(drafter, grown, target)
    with pytest.raises(ValueError, match="cannot shrink"):
        grown.grow_layers(2)



def test_widened_ar_head_drafts_what_it_did_until_trained(tmp_path, target):
    """`grow_ar_head` (warm-starting a wider AR head): same drafts and scores; the new units are real (moving them
    changes the drafts), the wider head saves and loads as such, and a head cannot be narrowed."""
    drafter = tiny_drafter("dfly", target)
    wide = tiny_drafter("dfly", target)
    narrow = wide.config.ar_head_intermediate_size
    wide.grow_ar_head(3 * narrow)
    head = wide.ar_head
    assert wide.config.ar_head_intermediate_size == head.down_proj.in_features == head.gate_proj.out_features == 3 * narrow
    assert head.gate_proj.weight[narrow:].any() and not head.down_proj.weight[:, narrow:].any()
    assert same_drafts(drafter, wide, target)
    wide.save_pretrained(tmp_path)
    loaded = AutoModel.from_pretrained(tmp_path).eval()
    assert loaded.config.ar_head_intermediate_size == 3 * narrow and same_drafts(wide, loaded, target)
    with torch.no_grad():
        wide.ar_head.down_proj.weight[:, narrow:].normal_(std=0.5)
    assert not same_drafts(drafter, wide, target)
    with pytest.raises(ValueError, match="cannot narrow"):
        wide.grow_ar_head(narrow)
    with pytest.raises(ValueError, match="no AR head"):
        DFlyDrafter.from_target(target, **(FAMILIES["dfly"][1] | {"use_ar_head": False})).grow_ar_head(2 * narrow)

# ---- saving and loading --------------------------------------------------------------------------------------------
def test_save_load_round_trip(tmp_path, target, family):
    drafter = tiny_drafter(family, target)
    drafter.save_pretrained(tmp_path)
    files = sorted(p.name for p in tmp_path.iterdir())
    assert "model.safetensors" in files and not [f for f in files if f.endswith((".bin", ".pt"))]
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["model_type"] == type(drafter.config).model_type
    assert set(config["auto_map"]) == {"AutoConfig", "AutoModel"}
    for loaded in (type(drafter).from_pretrained(tmp_path), AutoModel.from_pretrained(tmp_path),
                   angelspec_hf.load_drafter(tmp_path)):
        assert type(loaded) is type(drafter)
        assert same_drafts(drafter, loaded.eval(), target)
    assert AutoConfig.from_pretrained(tmp_path).to_dict()["target_layer_ids"] == list(drafter.config.target_layer_ids)


REMOTE_CODE_CHECK = textwrap.dedent(
    """
    import sys, torch
    sys.modules["angelspec_hf"] = None  # this library is not installed here
    from transformers import AutoModel
    model = AutoModel.from_pretrained(sys.argv[1], trust_remote_code=True)
    assert type(model).__module__.startswith("transformers_modules"), type(model).__module__
    total = sum(p.double().sum().item() for p in model.parameters())
    # the copied code carries no generate() routing (that is the library's hook): a DFlash drafter runs on
    # transformers' built-in DFlash path, speculative greedy == plain greedy; the others say what to install
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    target = LlamaForCausalLM(LlamaConfig(vocab_size=99, hidden_size=32, intermediate_size=37, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, pad_token_id=0, eos_token_id=2)).eval()
    ids = torch.tensor([[5, 17, 33, 8]])
    kw = dict(max_new_tokens=16, do_sample=False, eos_token_id=None, pad_token_id=0)
    if model.supports_transformers_dflash:
        spec = target.generate(ids, assistant_model=model.eval(), speculation_type="dflash", **kw)
        assert torch.equal(target.generate(ids, **kw), spec)
    else:
        try:
            target.generate(ids, assistant_model=model.eval(), **kw)
            raise SystemExit("generate ran a drafter without the library's hook")
        except AttributeError as error:
            assert "pip install angelspec-hf" in str(error), error
    print(type(model).__name__, repr(total))
    """
)


def test_trust_remote_code_without_the_library(tmp_path, target, family):
    drafter = tiny_drafter(family, target)
    drafter.save_pretrained(tmp_path)
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_MODULES_CACHE=str(tmp_path / "modules"))
    run = subprocess.run([sys.executable, "-c", REMOTE_CODE_CHECK, str(tmp_path)], capture_output=True, text=True,
                         env=env, cwd=tmp_path, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    name, total = run.stdout.split()[-2:]
    assert name == type(drafter).__name__
    assert float(total) == pytest.approx(sum(p.double().sum().item() for p in drafter.parameters()), rel=1e-9)


def test_hub_id_resolves_from_offline_cache(tmp_path, target, monkeypatch):
    """A drafter pushed as `org/name` loads by that id from the local HF cache with HF_HUB_OFFLINE=1."""
    drafter = tiny_drafter("dfly", target)
    snapshot = tmp_path / "hub" / "models--angelspec--tiny-dfly" / "snapshots" / ("a" * 40)
    snapshot.mkdir(parents=True)
    drafter.save_pretrained(snapshot)
    refs = snapshot.parents[1] / "refs"
    refs.mkdir()
    (refs / "main").write_text("a" * 40)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)
    loaded = AutoModel.from_pretrained("angelspec/tiny-dfly", cache_dir=tmp_path / "hub")
    assert same_drafts(drafter, loaded.eval(), target)
