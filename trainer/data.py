"""TRAIN prompt sets from `../shared/data` (never the EVAL files), with the domain each one serves:
chat for the MTP drafter, code and math for DFly / DFlash (co-specialisation)."""

from __future__ import annotations

import hashlib
import json

from angelspec_hf.prompts import data_dir

TRAIN_SETS = {  # name: domain
    "sharegpt": "chat",
    "alpaca": "chat",
    "gpteacher_codegen": "code",
    "code_alpaca": "code",
    "gsm8k": "math",
}


def _instruction(row: dict) -> str:
    return row["instruction"] + (f"\n\n{row['input']}" if row.get("input") else "")


def load_train_prompts(name: str) -> list[dict]:
    """`[{"id", "prompt", "domain"}]` for a TRAIN set, in a fixed pseudo-random order (so any prefix is a fair sample)."""
    root = data_dir()
    if name == "sharegpt":
        rows = json.loads((root / "sharegpt" / "sharegpt_v3_sample.json").read_text(encoding="utf-8"))
        items = [(r["id"], r["conversations"][0]["value"]) for r in rows if r["conversations"][0]["from"] == "human"]
    elif name == "alpaca":
        rows = json.loads((root / "alpaca" / "alpaca_en_demo.json").read_text(encoding="utf-8"))
        items = [(f"alpaca-{i}", _instruction(r)) for i, r in enumerate(rows)]
    elif name == "gpteacher_codegen":
        rows = json.loads((root / "gpteacher_codegen" / "codegen-instruct.json").read_text(encoding="utf-8"))
        items = [(f"gpteacher-{i}", _instruction(r)) for i, r in enumerate(rows)]
    elif name == "code_alpaca":
        rows = json.loads((root / "code_alpaca" / "code_alpaca_2k.json").read_text(encoding="utf-8"))
        items = [(f"code_alpaca-{i}", _instruction(r)) for i, r in enumerate(rows)]
    elif name == "gsm8k":
        with open(root / "gsm8k" / "train.jsonl", encoding="utf-8") as f:
            items = [(f"gsm8k-{i}", json.loads(line)["question"]) for i, line in enumerate(f) if line.strip()]
    else:
        raise ValueError(f"unknown TRAIN set {name!r}; choose from {sorted(TRAIN_SETS)}")
    items = [(i, p) for i, p in items if p.strip()]
    items.sort(key=lambda item: hashlib.sha256(f"{name}:{item[0]}".encode()).hexdigest())
    return [{"id": i, "prompt": p, "domain": TRAIN_SETS[name]} for i, p in items]
