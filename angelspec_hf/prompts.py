"""Offline prompt sets from `$ANGELSPEC_DATA`, by default `../shared/data` beside a checkout (EVAL files: for
measuring only, never for training)."""

from __future__ import annotations

import gzip
import itertools
import json
import os
from pathlib import Path

EVAL_SETS = ("mt_bench", "humaneval", "gsm8k")
SPEC_BENCH_CATEGORIES = ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities",
                         "translation", "summarization", "qa", "math_reasoning", "rag")


DATA_ENV = "ANGELSPEC_DATA"


def data_dir() -> Path:
    """The prompt data folder: `$ANGELSPEC_DATA`, else the `shared/data` folder beside a checkout. Raises
    `FileNotFoundError` naming the variable when the folder is not there (an installed package has no default)."""
    if os.environ.get(DATA_ENV):
        path, where = Path(os.environ[DATA_ENV]).expanduser(), f"${DATA_ENV} is {os.environ[DATA_ENV]!r}"
    else:
        path = Path(__file__).resolve().parents[2] / "shared" / "data"
        where = f"${DATA_ENV} is not set and the default beside a checkout, {path}, is missing"
    if not path.is_dir():
        raise FileNotFoundError(f"no prompt data folder: {where}. Set {DATA_ENV} to the folder holding the prompt "
                                "sets (mt_bench/, humaneval/, gsm8k/, spec_bench/, and the TRAIN sets for training)")
    return path


def data_file(*parts: str) -> Path:
    """`data_dir() / parts`, or a `FileNotFoundError` naming the file, the folder and `$ANGELSPEC_DATA`."""
    root = data_dir()
    path = root.joinpath(*parts)
    if not path.is_file():
        raise FileNotFoundError(f"{'/'.join(parts)} is missing from the prompt data folder {root} "
                                f"(${DATA_ENV}={os.environ.get(DATA_ENV) or '<unset: the checkout default>'})")
    return path


def _jsonl(path: Path) -> list[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def load_eval_prompts(name: str, limit: int | None = None) -> list[str]:
    """First-turn user prompts of an EVAL set: `mt_bench`, `humaneval` (the function stub, as a completion request),
    `gsm8k` (test questions), `spec_bench` (round robin over its categories) or one Spec-Bench category
    (`spec_bench:translation`, see `SPEC_BENCH_CATEGORIES`)."""
    if name == "mt_bench":
        prompts = [row["turns"][0] for row in _jsonl(data_file("mt_bench", "question.jsonl"))]
    elif name == "humaneval":
        prompts = [
            "Complete the following Python function.\n\n" + row["prompt"]
            for row in _jsonl(data_file("humaneval", "HumanEval.jsonl.gz"))
        ]
    elif name == "gsm8k":
        prompts = [row["question"] for row in _jsonl(data_file("gsm8k", "test.jsonl"))]
    elif name == "spec_bench" or name.startswith("spec_bench:"):
        rows = _jsonl(data_file("spec_bench", "question.jsonl"))
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


def chat_ids(tokenizer, prompt: str) -> list[int]:
    """The ids of `prompt` as one user turn in the target's chat template, ready for the reply (every chat-templated
    prompt of the package — bench, engine, training data, regeneration — goes through here)."""
    encoded = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                            return_dict=True)
    return list(encoded["input_ids"])


def chat_input_ids(tokenizer, prompt: str, device=None):
    """`chat_ids` as a `[1, T]` tensor on `device` (default: the CPU; pass the model's device)."""
    import torch

    return torch.tensor([chat_ids(tokenizer, prompt)], dtype=torch.long, device=device)
