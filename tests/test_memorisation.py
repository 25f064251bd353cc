"""End-to-end alignment of regeneration → training → drafting: a drafter of each family trained
on two regenerated sequences of an unskewed tiny target (varied replies) must memorise them, i.e. draft for exactly
those prompts with τ near its block. Any off-by-one between the regenerated ids, the chat template, the features,
labels, positions or anchors of training and those of drafting keeps τ near 1 (`scripts/mutation_check.py` shifts the
training labels by one to prove this test catches it). The same check on the real target:
`python scripts/check_memorisation.py`."""

import json

import pytest
import torch

from angelspec_hf.prompts import chat_input_ids
from angelspec_hf.trainer.arguments import DrafterTrainingArguments
from angelspec_hf.trainer.data import load_train_prompts
from angelspec_hf.trainer.dataset import DrafterCollator, load_regenerated
from angelspec_hf.trainer.evaluation import whole_blocks
from angelspec_hf.trainer.regenerate import regenerate
from angelspec_hf.trainer.trainer import DrafterTrainer
from helpers import tiny_chat_target, tiny_drafter

NEW_TOKENS = 20


@pytest.fixture(scope="module")
def memorised_set(tmp_path_factory):
    folder = tmp_path_factory.mktemp("regenerated")
    target, tokenizer = tiny_chat_target(seed=3, favour=1.0)
    regenerate(target, tokenizer, load_train_prompts("gsm8k")[:2], folder / "gsm8k.jsonl", batch_size=2,
               max_new_tokens=NEW_TOKENS, max_prompt_tokens=200, progress=False)
    records = [json.loads(line) for line in open(folder / "gsm8k.jsonl")]
    replies = [r["response_ids"] for r in records]
    # the check has power only if the replies are varied: a reply that repeats one token is "memorised" off by one too
    assert min(len(set(r)) for r in replies) >= 6, replies
    return target, tokenizer, folder, records


@pytest.mark.parametrize("family", ["mtp", "dflash", "dfly"])
def test_drafter_memorises_its_training_sequences(memorised_set, tmp_path, family):
    target, tokenizer, folder, records = memorised_set
    drafter = tiny_drafter(family, target, seed=0).train()
    args = DrafterTrainingArguments(
        output_dir=str(tmp_path / "out"), drafter_type=family, block_size=4, mtp_num_steps=3, num_anchors=32,
        regenerated_dir=str(folder), train_sets=["gsm8k"], per_device_train_batch_size=2, learning_rate=1e-2,
        max_steps=150, warmup_steps=5, logging_steps=50, report_to=[], use_cpu=True, save_strategy="no", seed=0,
        dataloader_num_workers=0,
    )
    dataset = load_regenerated(tokenizer, folder, ["gsm8k"], max_length=args.max_seq_length)
    DrafterTrainer(drafter, args, target, train_dataset=dataset,
                   data_collator=DrafterCollator(tokenizer.pad_token_id)).train()
    drafter.eval()
    accepted = rounds = 0
    with whole_blocks(drafter), torch.no_grad():
        for rec in records:
            ids = chat_input_ids(tokenizer, rec["prompt"])
            out = target.generate(ids, assistant_model=drafter, max_new_tokens=NEW_TOKENS, do_sample=False)
            assert out[0, ids.shape[1]:].tolist() == rec["response_ids"][:NEW_TOKENS]  # lossless, and the same text
            stats = drafter.last_speculation_stats
            accepted, rounds = accepted + sum(stats.accepted), rounds + stats.rounds
    block = drafter.num_draft_tokens + 1
    tau = (accepted + rounds) / rounds
    assert tau >= 0.75 * block, f"{family}: tau {tau:.2f} of {block} on its own training sequences"
