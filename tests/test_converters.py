"""Foreign checkpoints load through `from_pretrained` unchanged: z-lab DFlash and Tencent AngelSpec DFly layouts,
written here file for file as those projects publish them (config.json keys, weight names)."""

import json

import pytest
import torch
from safetensors.torch import save_file

import angelspec_hf
from angelspec_hf import DFlashDrafter, DFlyDrafter, MTPDrafter
from angelspec_hf.modeling import export_zlab_dflash
from conftest import tiny_drafter
from test_drafters import _same_drafts


def _backbone(config) -> dict:
    return {
        "vocab_size": config.vocab_size, "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size, "num_hidden_layers": config.num_hidden_layers,
        "num_attention_heads": config.num_attention_heads, "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.head_dim, "rms_norm_eps": config.rms_norm_eps, "hidden_act": "silu",
        "max_position_embeddings": config.max_position_embeddings, "attention_bias": False,
        "rope_theta": config.rope_parameters["rope_theta"], "tie_word_embeddings": True, "dtype": "float32",
        "layer_types": ["full_attention"] * config.num_hidden_layers, "use_sliding_window": False,
        "sliding_window": None,
    }


def write_zlab_dflash(folder, drafter, nested_block_size=False):
    c = drafter.config
    config = _backbone(c) | {
        "architectures": ["DFlashDraftModel"], "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
        "model_type": "qwen3", "num_target_layers": c.num_target_layers,
        "dflash_config": {"mask_token_id": c.mask_token_id, "target_layer_ids": list(c.target_layer_ids)},
    }
    if nested_block_size:
        config["dflash_config"]["block_size"] = c.block_size
    else:
        config["block_size"] = c.block_size
    (folder / "config.json").write_text(json.dumps(config))
    save_file({k: v.contiguous() for k, v in drafter.state_dict().items()}, folder / "model.safetensors")


def write_angelspec_dfly(folder, drafter, target):
    c = drafter.config
    config = _backbone(c) | {
        "architectures": ["Qwen3DFlyModel"], "model_type": "qwen3", "tie_word_embeddings": False,
        "num_target_layers": len(c.target_layer_ids), "target_hidden_size": c.hidden_size,
        "target_num_hidden_layers": c.num_target_layers, "target_layer_ids": list(c.target_layer_ids),
        "mask_token_id": c.mask_token_id, "enable_hidden_correction": True,
        "hidden_correction_intermediate_size": None,
    }
    renames = {"fc.": "context_proj.", "hidden_norm.": "context_norm.", "norm.": "final_norm.",
               "ar_head.": "hidden_correction."}
    state = {"embed_tokens.weight": target.get_input_embeddings().weight.detach().clone()}
    for name, tensor in drafter.state_dict().items():
        new = next((v + name[len(k):] for k, v in renames.items() if name.startswith(k)), name)
        state[new] = tensor.contiguous()
    (folder / "config.json").write_text(json.dumps(config))
    save_file(state, folder / "model.safetensors")


@pytest.mark.parametrize("nested", [False, True])
def test_zlab_dflash_checkpoint(tmp_path, target, nested):
    drafter = tiny_drafter("dflash", target, target_layer_ids=[0, 2, 3])
    write_zlab_dflash(tmp_path, drafter, nested_block_size=nested)
    loaders = (DFlashDrafter.from_pretrained(tmp_path), angelspec_hf.load_drafter(tmp_path),
               DFlashDrafter.from_pretrained(tmp_path, attn_implementation="eager", trust_remote_code=False))
    for loaded in loaders:
        assert type(loaded) is DFlashDrafter
        assert loaded.config.block_size == drafter.config.block_size
        assert loaded.config.target_layer_ids == [0, 2, 3] and loaded.config.mask_token_id == drafter.config.mask_token_id
        assert _same_drafts(drafter, loaded, target)
    # and it then runs inside generate() like a native drafter
    ids = torch.tensor([[5, 9, 11, 4]])
    kw = dict(do_sample=False, max_new_tokens=20, eos_token_id=None, pad_token_id=0)
    assert torch.equal(target.generate(ids, **kw), target.generate(ids, **kw, assistant_model=loaded))
    assert loaders[2].config._attn_implementation == "eager"


def test_angelspec_dfly_checkpoint(tmp_path, target):
    drafter = tiny_drafter("dfly", target, target_layer_ids=[1, 3])
    write_angelspec_dfly(tmp_path, drafter, target)
    assert DFlyDrafter.from_pretrained(tmp_path).config.block_size == 8  # AngelSpec's released block size
    loaded = DFlyDrafter.from_pretrained(tmp_path, block_size=drafter.config.block_size)
    assert type(loaded) is DFlyDrafter and loaded.config.num_target_layers == 4
    assert loaded.config.target_layer_ids == [1, 3]
    assert _same_drafts(drafter, loaded, target)


def test_wrong_family_and_unsupported_variants(tmp_path, target):
    write_zlab_dflash(tmp_path, tiny_drafter("dflash", target))
    with pytest.raises(ValueError, match="z-lab DFlash checkpoint; load it with DFlashDrafter, not MTPDrafter"):
        MTPDrafter.from_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["layer_types"] = ["sliding_attention"] * config["num_hidden_layers"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="only full-attention drafter layers"):
        DFlashDrafter.from_pretrained(tmp_path)


def test_pruned_vocabulary_is_refused(tmp_path, target):
    write_angelspec_dfly(tmp_path, tiny_drafter("dfly", target), target)
    config = json.loads((tmp_path / "config.json").read_text())
    config["draft_vocab_size"] = 32
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="pruned draft vocabulary"):
        DFlyDrafter.from_pretrained(tmp_path)


def test_export_to_zlab_layout_loads_back(tmp_path, target):
    drafter = tiny_drafter("dflash", target, target_layer_ids=[0, 2, 3])
    export_zlab_dflash(drafter, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"] and config["model_type"] == "qwen3"
    assert config["dflash_config"] == {"mask_token_id": drafter.config.mask_token_id, "target_layer_ids": [0, 2, 3]}
    assert config["block_size"] == drafter.config.block_size and "auto_map" not in config
    loaded = DFlashDrafter.from_pretrained(tmp_path)
    assert _same_drafts(drafter, loaded, target)
    with pytest.raises(ValueError, match="only DFlashDrafter"):
        export_zlab_dflash(tiny_drafter("dfly", target), tmp_path / "x")


def test_export_command_round_trip(tmp_path, target):
    """`angelspec export SRC --out DEST` writes z-lab's layout and checks that it loads back unchanged."""
    from angelspec_hf.cli import main

    tiny_drafter("dflash", target).save_pretrained(tmp_path / "ours")
    assert main(["export", str(tmp_path / "ours"), "--out", str(tmp_path / "zlab")]) == 0
    assert json.loads((tmp_path / "zlab" / "config.json").read_text())["architectures"] == ["DFlashDraftModel"]
