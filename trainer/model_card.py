"""The model card a drafter is pushed with: what it drafts for, what it was trained on, and its measured τ."""

from __future__ import annotations

from pathlib import Path

_DATASET_IDS = {  # TRAIN sets → their public sources (for the card's `datasets:` metadata)
    "sharegpt": "anon8231489123/ShareGPT_Vicuna_unfiltered",
    "alpaca": "tatsu-lab/alpaca",
    "code_alpaca": "sahil280114/codealpaca",
    "gsm8k": "openai/gsm8k",
}


def model_card(drafter, base_model: str, train_sets, acceptance: dict, training: dict | None = None) -> str:
    """Markdown with a Hub YAML header. `acceptance` maps EVAL set → τ (greedy, temperature 0)."""
    c = drafter.config
    family = type(drafter).__name__
    block = getattr(c, "block_size", None)
    draft_desc = f"block size {block}" if block else f"{c.num_draft_tokens} draft tokens per round"
    header = ["---", f"base_model: {base_model}", "library_name: transformers", "tags:", "- speculative-decoding",
              "- angelspec", f"- {c.model_type}", "datasets:"]
    header += [f"- {_DATASET_IDS[s]}" for s in train_sets if s in _DATASET_IDS] + ["---", ""]
    rows = "\n".join(f"| {name} | {tau:.2f} | 0 (greedy) | {draft_desc} |" for name, tau in acceptance.items())
    trained = "\n".join(f"- {k}: {v}" for k, v in (training or {}).items())
    body = f"""# {family} drafter for {base_model}

A speculative-decoding drafter ({family}, `model_type: {c.model_type}`) trained with angelspec-hf on the target's
own (regenerated) responses to these prompt sets: {", ".join(train_sets)}.
It reads target layers {list(c.target_layer_ids)} and shares the target's embedding and LM head.

```python
import angelspec_hf
from transformers import AutoModel
drafter = AutoModel.from_pretrained("<this repo>")   # or trust_remote_code=True without angelspec_hf
out = target.generate(**inputs, assistant_model=drafter)   # identical tokens to target.generate(**inputs)
```

## Measured acceptance

Mean accepted length τ (tokens per target forward, bonus token included) with `generate(assistant_model=...)`:

| eval set | τ | temperature | drafting |
|---|---|---|---|
{rows}

## Training

{trained}
"""
    return "\n".join(header) + body


def write_model_card(folder, *args, **kwargs) -> Path:
    path = Path(folder) / "README.md"
    path.write_text(model_card(*args, **kwargs), encoding="utf-8")
    return path
