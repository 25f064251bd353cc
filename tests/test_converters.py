"""Foreign checkpoints load through `from_pretrained` unchanged: z-lab DFlash and Tencent AngelSpec DFly layouts,
written here file for file as those projects publish them (config.json keys, weight names). Exports: z-lab's DFlash
layout, and EAGLE-3's as vLLM and SGLang load it, checked against their loaders' name handling and an independent
re-implementation of their forward."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

import angelspec_hf
from angelspec_hf import DFlashDrafter, DFlyDrafter, MTPDrafter
from angelspec_hf.modeling import export_eagle, export_zlab_dflash
from helpers import tiny_drafter, tiny_target
from helpers import same_drafts


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
        assert same_drafts(drafter, loaded, target)
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
    assert same_drafts(drafter, loaded, target)


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
    assert same_drafts(drafter, loaded, target)
    with pytest.raises(ValueError, match="only DFlashDrafter"):
        export_zlab_dflash(tiny_drafter("dfly", target), tmp_path / "x")


def test_export_command_round_trip(tmp_path, target):
    """`angelspec export SRC --out DEST` writes z-lab's layout and checks that it loads back unchanged."""
    from angelspec_hf.cli import main

    tiny_drafter("dflash", target).save_pretrained(tmp_path / "ours")
    assert main(["export", str(tmp_path / "ours"), "--out", str(tmp_path / "zlab")]) == 0
    assert json.loads((tmp_path / "zlab" / "config.json").read_text())["architectures"] == ["DFlashDraftModel"]


# ---- EAGLE-3 (vLLM and SGLang) ---------------------------------------------------------------------------------------
# What the engines' loaders do with a checkpoint's tensor names, transcribed from their code so that the exported names
# are checked against it: vLLM `model_executor/models/llama_eagle3.py` (`Eagle3LlamaForCausalLM.load_weights`, then
# `LlamaModel.load_weights`) and SGLang `srt/models/llama_eagle3.py` (`LlamaForCausalLMEagle3.load_weights`).
_STACKED = ((".q_proj", ".qkv_proj"), (".k_proj", ".qkv_proj"), (".v_proj", ".qkv_proj"),
            (".gate_proj", ".gate_up_proj"), (".up_proj", ".gate_up_proj"))


def _stack(name):
    return next((name.replace(shard, fused) for shard, fused in _STACKED if shard in name), name)


def vllm_param_names(names):
    out = set()
    for name in names:
        if "t2d" in name:
            continue
        if "d2t" in name:
            out.add("draft_id_to_target_id")
            continue
        if "lm_head" not in name:
            name = "model." + name.replace("midlayer.", "layers.0.")
        out.add(_stack(name))
    return out


def sglang_param_names(names, params):
    out = set()
    for name in names:
        if "d2t" in name or "t2d" in name:  # d2t becomes `hot_token_id`, t2d is skipped
            continue
        name = _stack(name)
        name = name if name in params else f"model.{name}"
        assert name in params, f"SGLang would silently skip {name}"
        out.add(name)
    return out


_LAYER = ("self_attn.qkv_proj.weight", "self_attn.o_proj.weight", "mlp.gate_up_proj.weight", "mlp.down_proj.weight",
          "input_layernorm.weight", "hidden_norm.weight", "post_attention_layernorm.weight")
# the engines' parameters of a one-layer EAGLE-3 draft model, the embedding excepted (both share the target's)
VLLM_PARAMS = {"model.fc.weight", "model.norm.weight", "lm_head.weight"} | {f"model.layers.0.{n}" for n in _LAYER}
SGLANG_PARAMS = {"model.fc.weight", "model.norm.weight", "lm_head.weight"} | {f"model.midlayer.{n}" for n in _LAYER}


def _rms(x, weight, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def _rotate(x, positions, theta):  # neox-style rotary, as vLLM's `get_rope` and HF's `rotate_half`
    half = x.shape[-1] // 2
    inv_freq = 1.0 / theta ** (torch.arange(0, half, dtype=torch.float64) / half)
    angles = positions[:, None].double() * inv_freq[None]  # [T, hd/2]
    cos, sin = angles.cos()[:, None], angles.sin()[:, None]  # [T, 1, hd/2]
    first, second = x[..., :half], x[..., half:]
    return torch.cat([first * cos - second * sin, second * cos + first * sin], dim=-1)


def engine_eagle3_logits(folder, embed_weight, features, input_ids, steps):
    """An independent re-implementation of vLLM's / SGLang's EAGLE-3 drafting (llama_eagle3.py, greedy, one sequence)
    that reads the exported folder by its tensor and config names only, in float64. Step 1: rows t < T carry
    `fc(features[t])` with `embed(input_ids[t + 1])` at position t; every later step appends one row carrying the
    previous row's pre-norm output (no fc) with the embedding of the token just drafted. Returns `(tokens, logits)`,
    logits over the target vocabulary with -inf outside the draft vocabulary (vLLM's `compute_logits`)."""
    cfg = json.loads((folder / "config.json").read_text())
    w = {k: v.double() if v.is_floating_point() else v for k, v in load_file(folder / "model.safetensors").items()}
    eps, theta, hd = cfg["rms_norm_eps"], cfg["rope_theta"], cfg["head_dim"]
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    layer = {k.removeprefix("midlayer."): v for k, v in w.items() if k.startswith("midlayer.")}
    embed = embed_weight.double()
    draft_to_target = torch.arange(cfg["draft_vocab_size"]) + w.get("d2t", torch.zeros(cfg["draft_vocab_size"])).long()

    def run(hidden_in, embeds):  # one decoder layer over all rows, causal; returns the pre-norm outputs [T, H]
        n = hidden_in.shape[0]
        residual = hidden_in
        x = torch.cat([_rms(embeds, layer["input_layernorm.weight"], eps),
                       _rms(hidden_in, layer["hidden_norm.weight"], eps)], dim=-1)  # [T, 2H]: embeddings first
        q = (x @ layer["self_attn.q_proj.weight"].T).view(n, heads, hd)
        k = (x @ layer["self_attn.k_proj.weight"].T).view(n, kv_heads, hd)
        v = (x @ layer["self_attn.v_proj.weight"].T).view(n, kv_heads, hd)
        positions = torch.cat([torch.arange(len(features)), torch.arange(n - len(features)) + len(features)])
        q, k = _rotate(q, positions, theta), _rotate(k, positions, theta)
        k, v = (t.repeat_interleave(heads // kv_heads, dim=1) for t in (k, v))
        scores = torch.einsum("qhd,khd->hqk", q, k) * hd**-0.5
        scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
        attn = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(n, heads * hd)
        residual = attn @ layer["self_attn.o_proj.weight"].T + residual
        h = _rms(residual, layer["post_attention_layernorm.weight"], eps)
        mlp = (torch.nn.functional.silu(h @ layer["mlp.gate_proj.weight"].T) * (h @ layer["mlp.up_proj.weight"].T))
        return mlp @ layer["mlp.down_proj.weight"].T + residual

    hidden_in = features.double() @ w["fc.weight"].T  # [T, H]
    embeds = embed[input_ids[1:]]
    tokens, logits = [], []
    for _ in range(steps):
        prenorm = run(hidden_in, embeds)[-1]
        draft_logits = _rms(prenorm, w["norm.weight"], eps) @ w["lm_head.weight"].T  # [draft_vocab]
        full = torch.full((cfg["vocab_size"],), float("-inf"), dtype=torch.float64)
        full[draft_to_target] = draft_logits
        token = int(full.argmax())
        tokens.append(token)
        logits.append(full)
        hidden_in = torch.cat([hidden_in, prenorm[None]])
        embeds = torch.cat([embeds, embed[token][None]])
    return tokens, torch.stack(logits)


def _eagle3_drafter(target, pruned=True, **overrides):
    drafter = tiny_drafter("mtp_eagle3", target, **overrides)
    with torch.no_grad():  # trained-looking norms, so that a misplaced norm shows
        for name, p in drafter.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    if pruned:
        drafter.set_draft_vocab([3, 4, 5, 7, 11, 20, 33, 40, 57, 61, 80, 98])
    return drafter


@pytest.mark.parametrize("pruned", [True, False])
def test_eagle3_export_has_the_engines_names_shapes_and_config(tmp_path, target, pruned):
    drafter = _eagle3_drafter(target, pruned)
    export_eagle(drafter, tmp_path, target)
    c, cfg = drafter.config, json.loads((tmp_path / "config.json").read_text())
    state = load_file(tmp_path / "model.safetensors")
    H, heads, kv, hd, inter, V = c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim, 37, 99
    draft_vocab = 12 if pruned else V
    shapes = {"fc.weight": (H, 3 * H), "norm.weight": (H,), "lm_head.weight": (draft_vocab, H),
              "midlayer.input_layernorm.weight": (H,), "midlayer.hidden_norm.weight": (H,),
              "midlayer.post_attention_layernorm.weight": (H,), "midlayer.self_attn.q_proj.weight": (heads * hd, 2 * H),
              "midlayer.self_attn.k_proj.weight": (kv * hd, 2 * H), "midlayer.self_attn.v_proj.weight": (kv * hd, 2 * H),
              "midlayer.self_attn.o_proj.weight": (H, heads * hd), "midlayer.mlp.gate_proj.weight": (inter, H),
              "midlayer.mlp.up_proj.weight": (inter, H), "midlayer.mlp.down_proj.weight": (H, inter)}
    if pruned:
        shapes |= {"d2t": (draft_vocab,), "t2d": (V,)}
        assert state["d2t"].dtype == torch.int64 and state["t2d"].dtype == torch.bool
        ids = drafter.draft_vocab_ids
        assert torch.equal(torch.arange(draft_vocab) + state["d2t"], ids)  # offsets, not ids
        assert torch.equal(state["t2d"].nonzero().flatten(), ids)
    assert {k: tuple(v.shape) for k, v in state.items()} == shapes
    ids = drafter.draft_vocab_ids if pruned else torch.arange(V)
    assert torch.equal(state["lm_head.weight"], target.lm_head.weight[ids])  # the target's own rows
    assert vllm_param_names(state) == VLLM_PARAMS | ({"draft_id_to_target_id"} if pruned else set())
    assert sglang_param_names(state, SGLANG_PARAMS) == SGLANG_PARAMS
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["model_type"] == "llama"
    assert cfg["num_hidden_layers"] == 1 and cfg["draft_vocab_size"] == draft_vocab and cfg["vocab_size"] == V
    assert cfg["target_hidden_size"] == H and cfg["tie_word_embeddings"] is False  # SGLang ties the head otherwise
    assert cfg["eagle_config"]["use_aux_hidden_state"] is True and cfg["head_dim"] == hd
    # layers [0, 1, 2] of a 4-layer target are not the engines' default, so both are told, each in its convention
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]  # vLLM: the layers whose input it captures
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 1, 2]  # SGLang: adds 1 itself


def test_eagle3_export_of_default_layers_names_none(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    deep = LlamaForCausalLM(LlamaConfig(**(tiny_target().config.to_dict() | {"num_hidden_layers": 8}))).eval()
    drafter = MTPDrafter.from_target(deep, layout="eagle3")
    assert drafter.config.target_layer_ids == [1, 3, 4]  # the inputs of layers 2, 4, 5: vLLM's and SGLang's default
    cfg = json.loads((export_eagle(drafter, tmp_path, deep) / "config.json").read_text())
    assert "eagle_aux_hidden_state_layer_ids" not in cfg and "eagle_aux_hidden_state_layer_ids" not in cfg["eagle_config"]


@pytest.mark.parametrize("pruned", [True, False])
def test_eagle3_export_loads_back_and_stays_lossless(tmp_path, target, pruned):
    drafter = _eagle3_drafter(target, pruned)
    export_eagle(drafter, tmp_path, target)
    for loaded in (MTPDrafter.from_pretrained(tmp_path), angelspec_hf.load_drafter(tmp_path)):
        assert type(loaded) is MTPDrafter and loaded.config.layout == "eagle3"
        assert loaded.config.target_layer_ids == [0, 1, 2] and loaded.config.num_target_layers == 4
        assert loaded.config.draft_vocab_size == drafter.config.draft_vocab_size
        mine, theirs = drafter.state_dict(), loaded.state_dict()
        assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)
        assert same_drafts(drafter, loaded, target)
    ids = torch.tensor([[5, 9, 11, 4]])
    kw = dict(do_sample=False, max_new_tokens=20, eos_token_id=None, pad_token_id=0)
    assert torch.equal(target.generate(ids, **kw), target.generate(ids, **kw, assistant_model=loaded))


@pytest.mark.parametrize("pruned", [True, False])
def test_eagle3_engine_reference_drafts_what_our_drafter_drafts(tmp_path, target, pruned):
    """The exported folder, run by an independent transcription of the engines' forward, gives our drafter's drafts
    and draft logits: the layout, the norms' places, the residual, the chaining and d2t all agree."""
    drafter = _eagle3_drafter(target, pruned, num_draft_tokens=4)
    export_eagle(drafter, tmp_path, target)
    g = torch.Generator().manual_seed(4)
    features, ids = torch.randn(1, 9, 3 * 32, generator=g), torch.randint(3, 99, (1, 10), generator=g)
    tokens, logits = drafter.propose(
        drafter.new_draft_state(), context_hidden_states=features, input_ids=ids, num_tokens=4,
        embed_tokens=target.get_input_embeddings(), lm_head=drafter.draft_lm_head(target.get_output_embeddings()),
        select=lambda lg, j: (lg.argmax(-1), lg.float(), None))
    ref_tokens, ref_logits = engine_eagle3_logits(tmp_path, target.get_input_embeddings().weight.detach(), features[0],
                                                  ids[0], steps=4)
    assert tokens[0].tolist() == ref_tokens
    torch.testing.assert_close(logits[0].double(), ref_logits, rtol=1e-4, atol=1e-4)
    assert torch.isinf(ref_logits).any() == pruned


def test_eagle3_export_refuses_what_it_cannot_express(tmp_path, target):
    with pytest.raises(ValueError, match="layout='angelspec'.*config_overrides layout=eagle3"):
        export_eagle(tiny_drafter("mtp", target), tmp_path, target)
    with pytest.raises(ValueError, match="not DFlashDrafter.*export_zlab_dflash"):
        export_eagle(tiny_drafter("dflash", target), tmp_path, target)
    with pytest.raises(ValueError, match="not DFlyDrafter.*angelspec serve"):
        export_eagle(tiny_drafter("dfly", target), tmp_path, target)
    wide = tiny_target(vocab_size=101)
    with pytest.raises(ValueError, match="vocab_size"):
        export_eagle(_eagle3_drafter(target), tmp_path, wide)
    # a third-party EAGLE-3 checkpoint trains its own LM head: refused, not loaded with the target's head in its place
    export_eagle(_eagle3_drafter(target), tmp_path, target)
    config = json.loads((tmp_path / "config.json").read_text())
    del config["angelspec"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="its own trained LM head"):
        angelspec_hf.load_drafter(tmp_path)


def test_export_command_writes_eagle3(tmp_path, target):
    from angelspec_hf.cli import main

    _eagle3_drafter(target).save_pretrained(tmp_path / "ours")
    target.save_pretrained(tmp_path / "target")
    args = ["export", str(tmp_path / "ours"), "--format", "eagle3", "--target", str(tmp_path / "target")]
    assert main(args + ["--out", str(tmp_path / "eagle")]) == 0
    assert json.loads((tmp_path / "eagle" / "config.json").read_text())["architectures"] == ["LlamaForCausalLMEagle3"]
    tiny_drafter("mtp", target).save_pretrained(tmp_path / "default_layout")
    args[1] = str(tmp_path / "default_layout")
    assert main(args + ["--out", str(tmp_path / "refused")]) == 1
