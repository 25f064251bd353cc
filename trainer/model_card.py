"""The model card a drafter is pushed with: what it drafts for, what it was trained on, and its measured τ."""

from __future__ import annotations

from pathlib import Path

from angelspec_hf.policy.corpus import LOOKUP_CORPUS_FILE, CorpusIndex

from .compute_curve import card_section

_DATASET_IDS = {  # TRAIN sets → their public sources (for the card's `datasets:` metadata)
    "sharegpt": "anon8231489123/ShareGPT_Vicuna_unfiltered",
    "alpaca": "tatsu-lab/alpaca",
    "code_alpaca": "sahil280114/codealpaca",
    "gsm8k": "openai/gsm8k",
}


ACCEPTANCE_HEADER = "| eval set | τ | first token accepted | temperature | measured on |\n|---|---|---|---|---|"


def acceptance_rows(acceptance: dict, draft_desc: str) -> str:
    """Table rows: `acceptance` maps EVAL set → τ (greedy, whole blocks, from the training run's eval), or
    `(set, temperature)` → `{"tau", "first", "prompts", "tokens"}` (from `angelspec bench`)."""
    rows = []
    for key, value in acceptance.items():
        if isinstance(value, dict):
            name, temperature = key
            rows.append(f"| {name} | {value['tau']:.2f} | {value['first']:.2f} | {temperature:g} | "
                        f"{value['prompts']} prompts × {value['tokens']} tokens, {draft_desc} |")
        else:
            rows.append(f"| {key} | {value:.2f} | | 0 (greedy) | {draft_desc} |")
    return "\n".join(rows)


def plot_loss_curve(log_history: list[dict], path) -> Path | None:
    """The training loss against the step (and the eval τ per set on a second axis) as a PNG; None without logs."""
    losses = [(h["step"], h["loss"]) for h in log_history if "loss" in h and "step" in h]
    if not losses:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.2))
    ax.plot(*zip(*losses), color="tab:blue", lw=1)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss", color="tab:blue")
    names = sorted({k for h in log_history for k in h if k.startswith("tau/")})
    taus = {k: [(h["step"], h[k]) for h in log_history if k in h and "step" in h] for k in names}
    if taus:
        ax2 = ax.twinx()
        for name, points in taus.items():
            ax2.plot(*zip(*points), marker="o", label=name)
        ax2.set_ylabel("eval τ (greedy)")
        ax2.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return Path(path)


def corpus_section(num_sequences: int, num_tokens: int) -> str:
    """The card's section on the folder's `lookup_corpus.safetensors`."""
    return f"""## Lookup corpus

`lookup_corpus.safetensors` holds {num_sequences:,} of the target's own replies ({num_tokens:,} tokens) to the
training prompts, as token ids. Loaded with the drafter (as `drafter.lookup_corpus`), it lets angelspec-hf's
generate() hook and batched engine verify, in place of a drafted block, what followed the context in those replies
(corpus lookups): proposals checked by the target like any draft, so the output is unchanged. Set
`drafter.lookup_corpus = None` to draft without it.
"""


def model_card(drafter, base_model: str, train_sets, acceptance: dict, training: dict | None = None,
               loss_curve: str | None = None, compute_curve: str | None = None,
               corpus: tuple[int, int] | None = None) -> str:
    """Markdown with a Hub YAML header; `acceptance` as `acceptance_rows` takes it; `loss_curve` a PNG beside it;
    `compute_curve` the held-out τ against training blocks section (`compute_curve.card_section`); `corpus`:
    `(sequences, tokens)` of a lookup corpus beside it (`corpus_section`)."""
    c = drafter.config
    family = type(drafter).__name__
    block = getattr(c, "block_size", None)
    draft_desc = f"block size {block}" if block else f"{c.num_draft_tokens} draft tokens per round"
    header = ["---", f"base_model: {base_model}", "library_name: transformers", "tags:", "- speculative-decoding",
              "- angelspec", f"- {c.model_type}", "datasets:"]
    header += [f"- {_DATASET_IDS[s]}" for s in train_sets if s in _DATASET_IDS] + ["---", ""]
    rows = acceptance_rows(acceptance, draft_desc)
    trained = "\n".join(f"- {k}: {v}" for k, v in (training or {}).items())
    if loss_curve:
        trained += f"\n\n![training loss and eval τ]({loss_curve})"
    if compute_curve:
        trained += f"\n\n### Held-out τ against training compute\n\n{compute_curve}"
    body = f"""# {family} drafter for {base_model}

A speculative-decoding drafter ({family}, `model_type: {c.model_type}`) trained with angelspec-hf on the target's
own (regenerated) responses to these prompt sets: {", ".join(train_sets)}.
It reads target layers {list(c.target_layer_ids)} and shares the target's embedding and LM head.

```python
import angelspec_hf
from transformers import AutoModel
drafter = AutoModel.from_pretrained("<this repo>")   # `import angelspec_hf` enables the generate() hook
out = target.generate(**inputs, assistant_model=drafter)   # identical tokens to target.generate(**inputs)
```

## Measured acceptance

Mean accepted length τ (tokens per target forward, bonus token included) and the share of rounds whose first draft
token was accepted, with `generate(assistant_model=...)`, whole blocks drafted:

{ACCEPTANCE_HEADER}
{rows}

## Training

{trained}
"""
    if corpus is not None:
        body += "\n" + corpus_section(*corpus)
    return "\n".join(header) + body


def write_model_card(folder, *args, log_history=None, blocks_before: int = 0, ends_before=(), settings=None,
                     **kwargs) -> Path:
    """README.md in `folder` (and from the trainer's `log_history`, when given: `loss_curve.png`, and
    `tau_by_compute.png` when the run logged held-out τ at two or more points, plotted against every block the drafter
    has seen, `blocks_before` the run included, and fitted through the pieces' ends when `ends_before` gives the
    earlier ones: `compute_curve.card_section`)."""
    if log_history and plot_loss_curve(log_history, Path(folder) / "loss_curve.png"):
        kwargs["loss_curve"] = "loss_curve.png"
    if log_history and (section := card_section(log_history, folder, blocks_before, ends_before, settings)):
        kwargs["compute_curve"] = section
    if (Path(folder) / LOOKUP_CORPUS_FILE).is_file() and "corpus" not in kwargs:
        corpus = CorpusIndex.load(folder)
        kwargs["corpus"] = (corpus.num_sequences, len(corpus))
    path = Path(folder) / "README.md"
    path.write_text(model_card(*args, **kwargs), encoding="utf-8")
    return path
