"""Training examples from target-regenerated responses: chat template applied, loss only on the assistant's tokens."""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from angelspec_hf.prompts import chat_ids
from angelspec_hf.trainer.regenerated_files import read_records, regenerated_file


def tokenize_example(tokenizer, prompt: str, response_ids: list[int], max_length: int) -> dict:
    """`input_ids` = the chat-templated prompt (with the generation prompt) + the target's own response ids;
    `supervised` marks the response tokens (the only ones with a loss)."""
    prompt_ids = chat_ids(tokenizer, prompt)
    ids = (prompt_ids + list(response_ids))[:max_length]
    supervised = ([0] * len(prompt_ids) + [1] * len(response_ids))[:max_length]
    return {"input_ids": ids, "supervised": supervised}


def load_regenerated(
    tokenizer, folder, sets, max_length: int = 768, max_samples: int | None = None, seed: int = 0,
    min_supervised: int = 8,
):
    """A `datasets.Dataset` mixing the regenerated `<set>.jsonl.gz` (or plain `<set>.jsonl`) files of `folder`
    (shuffled with `seed`), with columns `input_ids`, `supervised`, `example_index` (a stable id used to seed
    per-example anchor sampling). `FileNotFoundError` naming both paths when a set has neither."""
    from datasets import Dataset

    rows = []
    for name in sets:
        for rec in read_records(regenerated_file(folder, name)):
            example = tokenize_example(tokenizer, rec["prompt"], rec["response_ids"], max_length)
            if sum(example["supervised"]) >= min_supervised:
                rows.append(example | {"source": name})
    random.Random(seed).shuffle(rows)
    rows = rows[:max_samples]
    for i, row in enumerate(rows):
        row["example_index"] = i
    return Dataset.from_list(rows)


@dataclass
class DrafterCollator:
    """Right-pads a batch. `labels` (supervised tokens, -100 elsewhere) is what the Trainer counts for
    `num_items_in_batch`; cached `features` / `final` target states (when present) are padded with zeros."""

    pad_token_id: int

    def __call__(self, examples: list[dict]) -> dict:
        width = max(len(e["input_ids"]) for e in examples)

        def pad(key, value):
            return torch.tensor([e[key] + [value] * (width - len(e[key])) for e in examples])

        input_ids = pad("input_ids", self.pad_token_id)
        supervised = pad("supervised", 0).bool()
        batch = {
            "input_ids": input_ids,
            "attention_mask": pad("input_ids", -1).ne(-1).long(),
            "supervised": supervised,
            "labels": input_ids.masked_fill(~supervised, -100),
            "example_index": torch.tensor([e["example_index"] for e in examples]),
        }
        for key in ("features", "final"):  # cached target states
            if key in examples[0]:
                states = [torch.as_tensor(e[key], dtype=torch.float16) for e in examples]
                out = states[0].new_zeros(len(states), width, states[0].shape[-1])
                for i, f in enumerate(states):
                    out[i, : f.shape[0]] = f
                batch[key] = out
        return batch
