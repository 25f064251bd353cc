"""Offline prompt sets from `../shared/data` (EVAL files: for measuring only, never for training)."""

from __future__ import annotations

import gzip
import itertools
import json
import os
from pathlib import Path

EVAL_SETS = ("mt_bench", "humaneval", "gsm8k")
SPEC_BENCH_CATEGORIES = ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities",
                         "translation", "summarization", "qa", "math_reasoning", "rag")


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
    """First-turn user prompts of an EVAL set: `mt_bench`, `humaneval` (the function stub, as a completion request),
    `gsm8k` (test questions), `spec_bench` (round robin over its categories) or one Spec-Bench category
    (`spec_bench:translation`, see `SPEC_BENCH_CATEGORIES`)."""
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
    elif name == "spec_bench" or name.startswith("spec_bench:"):
        rows = _jsonl(root / "spec_bench" / "question.jsonl")
        by_category = {c: [r["turns"][0] for r in rows if r["category"] == c] for c in SPEC_BENCH_CATEGORIES}
        if name == "spec_bench":
            prompts = [p for group in itertools.zip_longest(*by_category.values()) for p in group if p is not None]
        elif name[len("spec_bench:"):] in by_category:
            prompts = by_category[name[len("spec_bench:"):]]
        else:
            raise ValueError(f"unknown Spec-Bench category in {name!r}; choose one of {SPEC_BENCH_CATEGORIES}")
    else:
        raise ValueError(f"unknown eval set {name!r}; choose one of {EVAL_SETS}, spec_bench or "
                         f"spec_bench:<category>")
    return prompts[:limit]


def chat_input_ids(tokenizer, prompt: str):
    """`[1, T]` input ids of `prompt` as one user turn in the target's chat template, ready for the reply."""
    encoded = tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    return encoded["input_ids"]
