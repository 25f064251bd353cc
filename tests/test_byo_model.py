# Bring your own model: a target folder (config.json, weights, and a tokenizer with a chat template) taken through
# the whole CLI path, as a user runs it. The commands this test runs, with ./my-model the target folder (a real run
# uses more prompts and tokens, e.g. --limit 2000 --max-new-tokens 256, and --max_steps in the thousands):
#
#   angelspec regenerate --target ./my-model --sets gsm8k --limit 8 --batch-size 8 --max-new-tokens 24 \
#       --out ./my-model-data
#   angelspec train --target ./my-model --regenerated_dir ./my-model-data --train_sets gsm8k --drafter_type dfly \
#       --output_dir ./runs/my-dfly --max_steps 2 --per_device_train_batch_size 2 --max_seq_length 128 --report_to none
#   angelspec generate --target ./my-model --drafter ./runs/my-dfly --max-new-tokens 24 --repeats 1 \
#       --prompt "What is 12 * 7?"
#
# (the Qwen2 target trains an MTP drafter: --drafter_type mtp, --output_dir ./runs/my-mtp)
"""Bring your own model: tiny random Llama and Qwen2 targets saved as HF folders go through `angelspec regenerate`,
`angelspec train` and `angelspec generate` (`angelspec_hf.cli.main`, what the console script runs, with the same
arguments); the text `generate` prints is the target's own greedy text, and the trained drafter, drafting whole
blocks, gives the target's greedy tokens."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

import angelspec_hf
from angelspec_hf.cli import main
from angelspec_hf.prompts import chat_input_ids
from angelspec_hf.targets import load_default_tokenizer

PROMPT = "What is 12 * 7?"
NEW_TOKENS = 24
ARCHITECTURES = {"llama": (LlamaConfig, LlamaForCausalLM, "dfly"), "qwen2": (Qwen2Config, Qwen2ForCausalLM, "mtp")}


def angelspec(capsys, *args) -> str:
    """`angelspec <args>`: its stdout, after checking that it succeeded."""
    code = main([str(arg) for arg in args])
    out = capsys.readouterr().out
    assert code == 0, f"angelspec {args[0]} exited with {code}:\n{out[-3000:]}"
    return out


def save_tiny_target(architecture: str, folder) -> None:
    """A random 4-layer target of `architecture` with the embedded target's real tokenizer (vocabulary and chat
    template), saved as a normal HF folder."""
    config_cls, model_cls, _ = ARCHITECTURES[architecture]
    tokenizer = load_default_tokenizer()
    torch.manual_seed(0)
    config = config_cls(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=37, num_hidden_layers=4,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                        pad_token_id=tokenizer.eos_token_id)
    model_cls(config).eval().save_pretrained(folder)
    tokenizer.save_pretrained(folder)


@pytest.mark.parametrize("architecture", sorted(ARCHITECTURES))
def test_regenerate_train_generate_on_your_own_model(architecture, tmp_path, capsys):
    family = ARCHITECTURES[architecture][2]
    target_dir, data_dir, run_dir = tmp_path / "my-model", tmp_path / "my-model-data", tmp_path / "runs" / family
    save_tiny_target(architecture, target_dir)

    out = angelspec(capsys, "regenerate", "--target", target_dir, "--sets", "gsm8k", "--limit", 8, "--batch-size", 8,
                    "--max-new-tokens", NEW_TOKENS, "--out", data_dir)
    assert "'written': 8" in out and (data_dir / "gsm8k.jsonl.gz").is_file()

    angelspec(capsys, "train", "--target", target_dir, "--regenerated_dir", data_dir, "--train_sets", "gsm8k",
              "--drafter_type", family, "--output_dir", run_dir, "--max_steps", 2, "--per_device_train_batch_size", 2,
              "--max_seq_length", 128, "--report_to", "none")
    assert {"config.json", "model.safetensors", "README.md"} <= {p.name for p in run_dir.iterdir()}

    out = angelspec(capsys, "generate", "--target", target_dir, "--drafter", run_dir, "--max-new-tokens", NEW_TOKENS,
                    "--repeats", 1, "--prompt", PROMPT)
    assert "identical to plain : yes (1/1 runs)" in out and "nan" not in out.split("--- speculative decoding ---")[1]
    printed = out.split("--- generated text ---\n", 1)[1].split("\n--- speculative decoding ---", 1)[0]

    # the same, checked here: the target's own greedy text, and the drafter drafting every round gives its tokens
    target, tokenizer = angelspec_hf.load_target(str(target_dir))
    ids = chat_input_ids(tokenizer, PROMPT)
    plain = target.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False)
    assert printed == tokenizer.decode(plain[0, ids.shape[1]:], skip_special_tokens=True)
    drafter = angelspec_hf.load_drafter(str(run_dir))
    assert type(drafter).__name__ == {"dfly": "DFlyDrafter", "mtp": "MTPDrafter"}[family]
    drafter.config.draft_length, drafter.config.lookup_tokens = "full", 0
    spec = target.generate(ids, assistant_model=drafter, max_new_tokens=NEW_TOKENS, do_sample=False)
    assert torch.equal(spec, plain) and drafter.last_speculation_stats.rounds > 0
