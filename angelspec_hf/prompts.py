"""Offline prompt sets from `../shared/data` (EVAL files: for measuring only, never for training)."""

from __future__ import annotations

import gzip
import json
import os
from pathlib import Path

EVAL_SETS = ("mt_bench", "humaneval", "gsm8k")


def data_dir() -> Path:
    """`$ANGELSPEC_DATA`, else the `shared/data` folder beside this checkout."""
    if os.environ.get("ANGELSPEC_DATA"):
        return Path(os.environ["ANGELSPEC_DATA"])
    return Path(__file__).resolve().parents[2] / "shared" / "data"


def _jsonl(path: Path) -> list[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def load_eval_prompts(name: str, limit: int | None = None) -> list[str]:
    """First-turn user prompts of an EVAL set: `mt_bench`, `humaneval` (the function stub, as a completion request)
    or `gsm8k` (test questions)."""
    root = data_dir()
    if name == "mt_bench":
        prompts = [row["turns"][0] for row in _jsonl(root / "mt_bench" / "question.jsonl")]
    elif name == "humaneval":
        prompts = [
            "Complete the following Python function.\n\n" + row["prompt"]
            for row in _jsonl(root / "humaneval" / "HumanEval.jsonl.gz")
        ]
    elif name == "gsm8k":
        prompts = [row["question"] for row in _jsonl(root / "gsm8k" / "test.jsonl")]
    else:
        raise ValueError(f"unknown eval set {name!r}; choose one of {EVAL_SETS}")
    return prompts[:limit]


def chat_input_ids(tokenizer, prompt: str):
    """`[1, T]` input ids of `prompt` as one user turn in the target's chat template, ready for the reply."""
    encoded = tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    return encoded["input_ids"]
