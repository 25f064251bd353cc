"""Held-out τ of a drafter against the training it has had: the curve issue #13 asks for when a target is out of reach.

Each checkpoint is `label:steps:source`, where steps is the cumulative optimiser steps behind it and source a drafter
folder or `git:<rev>:<path>` (a drafter committed at that revision, e.g. an earlier shipped round). Every checkpoint
drafts for the same prompts with the same target: greedy, whole blocks, no n-gram lookups (the drafter alone), 64 new
tokens, on held-out TRAIN prompts that were never regenerated (`tune_stop_threshold.held_out_prompts`, never EVAL).

    python scripts/tau_by_training.py --out outputs/tau-by-training \\
        "round 1:800:git:7752a0e:drafters/smollm2-135m-instruct-dfly" ... "round 5:4400:drafters/smollm2-135m-instruct-dfly"

Writes `tau_by_training.json` and `tau_by_training.png` (τ and first-token acceptance against cumulative steps).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import angelspec_hf  # noqa: E402
from angelspec_hf.shipped import drafter_for_target  # noqa: E402
from angelspec_hf.trainer.evaluation import measure_acceptance  # noqa: E402
from angelspec_hf.weights_store import MANIFEST, WeightFile, write_blob  # noqa: E402
from tune_stop_threshold import held_out_prompts  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def parse_checkpoint(spec: str) -> tuple[str, int, str]:
    label, steps, source = spec.split(":", 2)
    return label, int(steps), source


def materialise(source: str, scratch: Path) -> Path:
    """A drafter folder on disk: `source` itself, or the files committed under `git:<rev>:<path>`, with the weights
    that revision's `weights.json` beside the folder lists as git blobs (the shipped drafters' weights are kept so)."""
    if not source.startswith("git:"):
        return Path(source)
    _, rev, path = source.split(":", 2)
    out = scratch / rev
    out.mkdir(parents=True, exist_ok=True)
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev, path], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(out), "--strip-components", str(len(Path(path).parts))], input=archive,
                   check=True)
    manifest = subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:{Path(path).parent.as_posix()}/{MANIFEST}"],
                              capture_output=True, text=True)
    if manifest.returncode == 0:
        for entry in (WeightFile(**e) for e in json.loads(manifest.stdout)["files"]):
            folder, _, rel = entry.path.partition("/")
            if folder == Path(path).name and not (out / rel).exists():
                write_blob(ROOT, entry, out / rel)
    return out


def plot(rows: list[dict], path: Path) -> None:
    """τ (left axis) and first-token acceptance (right axis) against steps; a checkpoint at the same step count as an
    earlier one (a variant, e.g. a grown drafter) is drawn as a hollow marker beside the line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    line, variants, seen = [], [], set()
    for r in rows:
        (variants if r["steps"] in seen else line).append(r)
        seen.add(r["steps"])
    fig, ax = plt.subplots(figsize=(7.0, 4.0))
    right = ax.twinx()
    ax.plot([r["steps"] for r in line], [r["tau"] for r in line], "o-", color="C0", label="τ (left)")
    right.plot([r["steps"] for r in line], [r["first"] for r in line], "s--", color="C1",
               label="first-token acceptance (right)")
    for r in variants:
        ax.plot(r["steps"], r["tau"], "o", mfc="none", color="C0", ms=9)
        right.plot(r["steps"], r["first"], "s", mfc="none", color="C1", ms=9)
    for i, r in enumerate(line):  # labels alternately above and below the line
        ax.annotate(r["label"], (r["steps"], r["tau"]), textcoords="offset points", xytext=(-12, 8 if i % 2 else -16),
                    fontsize=7)
    for r in variants:
        ax.annotate(r["label"] + " (hollow)", (r["steps"], r["tau"]), textcoords="offset points", xytext=(-40, 22),
                    fontsize=7)
    ax.set_xlim(0, max(r["steps"] for r in rows) * 1.15)
    ax.axhline(3.0, color="grey", lw=0.8, ls=":", label="issue #13: τ 3.0")
    ax.set_ylim(1.0, 3.2)
    right.set_ylim(0.0, 1.0)
    ax.set_xlabel("cumulative training steps (4 sequences each)")
    ax.set_ylabel("τ: held-out, greedy, whole blocks of 8")
    right.set_ylabel("first draft token accepted")
    handles = ax.get_legend_handles_labels()[0] + right.get_legend_handles_labels()[0]
    ax.legend(handles, [h.get_label() for h in handles], fontsize=7, loc="upper left")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoints", nargs="*", help="label:steps:source (a folder or git:<rev>:<path>)")
    parser.add_argument("--sets", default="gsm8k,gpteacher_codegen",
                        help="TRAIN sets of the drafter's domain the held-out prompts come from, in equal parts")
    parser.add_argument("--prompts", type=int, default=12)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default="outputs/tau-by-training")
    parser.add_argument("--plot-only", action="store_true", help="redraw the PNG from the JSON in --out")
    args = parser.parse_args(argv)
    if args.plot_only:
        rows = json.loads((Path(args.out) / "tau_by_training.json").read_text())["rows"]
        plot(rows, Path(args.out) / "tau_by_training.png")
        return 0
    torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    target, tokenizer = angelspec_hf.load_default_target()
    prompts = held_out_prompts(args.sets.split(","), args.prompts)
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        for label, steps, source in map(parse_checkpoint, args.checkpoints):
            drafter = drafter_for_target(str(materialise(source, Path(scratch))), target)
            r = measure_acceptance(target, drafter, tokenizer, prompts, args.max_new_tokens)
            rows.append({"label": label, "steps": steps, "source": source, **r})
            print(f"{label:>24}  steps {steps:>5}  τ {r['tau']:.3f}  first {r['first']:.3f}  ({r['rounds']} rounds)",
                  flush=True)
    setting = {"sets": args.sets, "prompts": len(prompts), "max_new_tokens": args.max_new_tokens,
               "threads": args.threads, "decoding": "greedy, whole blocks, no lookups"}
    (out / "tau_by_training.json").write_text(json.dumps({"setting": setting, "rows": rows}, indent=1))
    plot(rows, out / "tau_by_training.png")
    print(f"wrote {out / 'tau_by_training.json'}, {out / 'tau_by_training.png'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
