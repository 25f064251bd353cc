"""The converted folder of the embedded target is an ordinary HF checkpoint: its safetensors keys are exactly the
parameter names the architecture declares (a tied weight once, under the name the architecture registers it by), so
loaders other than transformers read it. vLLM, for one, honours `tie_word_embeddings` by skipping `lm_head.weight`:
a folder holding the tied embedding only under that name loads with an empty embedding and generates token 0."""

import json

import pytest
import torch
from safetensors import safe_open
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from angelspec_hf.targets import _save_dequantised, converted_target_dir, default_target_path, load_default_target


def declared_weights(config) -> dict[str, tuple[int, ...]]:
    """`{name: shape}` of the weights a checkpoint of `config`'s architecture holds: its parameters, each shared one
    once under the name it was first registered by (`named_parameters` order), and its persistent buffers."""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    names = {name: tuple(p.shape) for name, p in model.named_parameters()}
    persistent = model.state_dict().keys()  # non-persistent buffers (rotary inv_freq) are not saved
    names |= {name: tuple(b.shape) for name, b in model.named_buffers() if name in persistent}
    return names


def folder_weights(folder) -> dict[str, tuple[int, ...]]:
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        return {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}


def test_declared_weights_of_a_tied_llama():
    config = LlamaConfig(hidden_size=32, intermediate_size=37, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=99, tie_word_embeddings=True)
    names = declared_weights(config)
    assert "model.embed_tokens.weight" in names and "lm_head.weight" not in names
    assert len(names) == 2 * 9 + 2  # per layer: q, k, v, o, gate, up, down, two norms; + embedding, final norm
    assert "lm_head.weight" in declared_weights(LlamaConfig(**(config.to_dict() | {"tie_word_embeddings": False})))


@pytest.mark.parametrize("tied", [True, False])
def test_save_dequantised_writes_the_declared_names(tmp_path, tied):
    """The conversion's writer, on a tiny Llama: the declared names and shapes, and `from_pretrained` reads back the
    same weights (the head equal to the embedding when tied)."""
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=32, intermediate_size=37, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=99, tie_word_embeddings=tied)
    model = LlamaForCausalLM(config).eval()
    _save_dequantised(model, tmp_path / "folder")
    assert folder_weights(tmp_path / "folder") == declared_weights(config)
    back = LlamaForCausalLM.from_pretrained(tmp_path / "folder").eval()
    a, b = model.state_dict(), back.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert torch.equal(back.lm_head.weight, model.model.embed_tokens.weight) == tied


@pytest.mark.real_model
def test_the_embedded_targets_folder_holds_the_declared_names():
    """The converted folder every loader reads (written by the first load of the embedded target): the keys and shapes
    the Llama architecture declares, the tied embedding as `model.embed_tokens.weight`, and no `lm_head.weight`."""
    target, _ = load_default_target()  # writes the folder when it is missing
    folder = converted_target_dir(default_target_path())
    config = AutoConfig.from_pretrained(folder)
    assert json.loads((folder / "config.json").read_text())["tie_word_embeddings"] is True
    weights = folder_weights(folder)
    assert weights == declared_weights(config)
    assert weights["model.embed_tokens.weight"] == (config.vocab_size, config.hidden_size)
    assert "lm_head.weight" not in weights
    with safe_open(str(folder / "model.safetensors"), "pt") as f:  # the embedding is the model's, not empty or zero
        embedding = f.get_tensor("model.embed_tokens.weight")
    assert torch.equal(embedding, target.get_input_embeddings().weight)
    assert torch.equal(embedding, target.get_output_embeddings().weight)
