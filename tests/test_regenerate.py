"""Self-distillation data: TRAIN loaders, and regeneration that resumes after a kill without repeating work."""

import json

import pytest

from angelspec_hf.trainer.data import TRAIN_SETS, load_train_prompts
from angelspec_hf.trainer.regenerate import regenerate
from helpers import tiny_chat_target


@pytest.mark.parametrize("name", sorted(TRAIN_SETS))
def test_train_sets_load_with_stable_ids(name):
    rows = load_train_prompts(name)
    assert len(rows) > 100 and all(r["prompt"].strip() for r in rows)
    assert len({r["id"] for r in rows}) == len(rows)
    assert rows[:5] == load_train_prompts(name)[:5]  # fixed order, so a prefix is reproducible
    assert {r["domain"] for r in rows} == {TRAIN_SETS[name]}


def test_regeneration_resumes(tmp_path):
    target, tokenizer = tiny_chat_target()
    records = load_train_prompts("gsm8k")[:5]
    out = tmp_path / "gsm8k.jsonl"
    first = regenerate(target, tokenizer, records[:3], out, batch_size=2, max_new_tokens=6, progress=False)
    assert first == {"written": 3, "skipped_long": 0, "done": 3}
    with open(out, "a") as f:  # a kill in the middle of writing the next line
        f.write('{"id": "' + records[3]["id"] + '", "prom')
    second = regenerate(target, tokenizer, records, out, batch_size=2, max_new_tokens=6, progress=False)
    assert second == {"written": 2, "skipped_long": 0, "done": 5}
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert [line["id"] for line in lines] == [r["id"] for r in records]
    assert all(line["num_tokens"] <= 6 and line["finish_reason"] in ("length", "eos_token") for line in lines)
    # Greedy responses do not depend on the batch they were generated in (left padding is masked out).
    alone = tmp_path / "alone.jsonl"
    regenerate(target, tokenizer, records[3:4], alone, batch_size=1, max_new_tokens=6, progress=False)
    assert json.loads(alone.read_text())["response"] == lines[3]["response"]
    assert regenerate(target, tokenizer, records, out, max_prompt_tokens=5, progress=False)["written"] == 0
