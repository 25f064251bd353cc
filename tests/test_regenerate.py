"""Self-distillation data: TRAIN loaders, and regeneration that resumes after a kill without repeating work, into
gzip (`<set>.jsonl.gz`, what the project keeps) or plain jsonl."""

import gzip
import json
from pathlib import Path

import pytest

from angelspec_hf.trainer.data import TRAIN_SETS, load_train_prompts
from angelspec_hf.trainer.regenerate import regenerate
from angelspec_hf.trainer.regenerated_files import (
    append_lines,
    done_ids,
    output_file,
    read_records,
    regenerated_file,
)
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


def test_gzip_regeneration_resumes_after_a_cut_member(tmp_path):
    """`<set>.jsonl.gz` (what the project keeps): each batch is appended as one gzip member, a member cut short by a
    kill is dropped on resume, and the records equal a plain run's."""
    target, tokenizer = tiny_chat_target()
    records = load_train_prompts("gsm8k")[:5]
    plain, packed = tmp_path / "plain" / "gsm8k.jsonl", tmp_path / "packed" / "gsm8k.jsonl.gz"
    regenerate(target, tokenizer, records, plain, batch_size=2, max_new_tokens=6, progress=False)
    regenerate(target, tokenizer, records[:3], packed, batch_size=2, max_new_tokens=6, progress=False)
    complete = packed.stat().st_size
    with open(packed, "ab") as f:  # a kill in the middle of writing the next member
        f.write(gzip.compress(plain.read_bytes().splitlines(keepends=True)[3])[:-7])
    assert done_ids(packed) == {r["id"] for r in records[:3]} and packed.stat().st_size == complete
    with open(packed, "ab") as f:  # ... or garbage after the last member
        f.write(b"\x1f\x8b\x08garbage")
    second = regenerate(target, tokenizer, records, packed, batch_size=2, max_new_tokens=6, progress=False)
    assert second == {"written": 2, "skipped_long": 0, "done": 5}
    assert gzip.decompress(packed.read_bytes()) == plain.read_bytes()  # the same records, byte for byte
    assert packed.read_bytes().count(b"\x1f\x8b\x08") >= 3  # 2 + 1 members: appended, never rewritten
    assert list(read_records(packed)) == list(read_records(plain))


def test_regenerated_files_take_either_format_and_refuse_ambiguity(tmp_path):
    lines = [json.dumps({"id": f"r{i}", "response_ids": [i]}) + "\n" for i in range(3)]
    assert output_file(tmp_path, "gsm8k") == tmp_path / "gsm8k.jsonl.gz"  # new files are gzip
    with pytest.raises(FileNotFoundError) as missing:
        regenerated_file(tmp_path, "gsm8k")
    assert f"neither {tmp_path / 'gsm8k.jsonl.gz'} nor {tmp_path / 'gsm8k.jsonl'} exists" in str(missing.value)
    (tmp_path / "gsm8k.jsonl").write_text("".join(lines))  # a user's plain file: read, and resumed into
    assert regenerated_file(tmp_path, "gsm8k") == output_file(tmp_path, "gsm8k") == tmp_path / "gsm8k.jsonl"
    assert done_ids(tmp_path / "gsm8k.jsonl") == {"r0", "r1", "r2"}
    append_lines(tmp_path / "alpaca.jsonl.gz", lines[:2])
    append_lines(tmp_path / "alpaca.jsonl.gz", lines[2:])
    assert [r["id"] for r in read_records(regenerated_file(tmp_path, "alpaca"))] == ["r0", "r1", "r2"]
    (tmp_path / "alpaca.jsonl").write_text(lines[0])
    with pytest.raises(ValueError, match="both .*alpaca.jsonl.gz and .*alpaca.jsonl exist"):
        regenerated_file(tmp_path, "alpaca")


def test_the_shipped_regenerated_data_is_gzip_jsonl():
    folder = Path(__file__).resolve().parent.parent / "data" / "regenerated" / "smollm2-135m-instruct"
    files = sorted(folder.glob("*.jsonl*"))
    assert [f.name for f in files] == [f"{n}.jsonl.gz" for n in
                                       ("alpaca", "code_alpaca", "gpteacher_codegen", "gsm8k", "sharegpt")]
    first = next(read_records(regenerated_file(folder, "alpaca")))
    assert {"id", "prompt", "response", "response_ids", "num_tokens", "finish_reason"} <= set(first)
