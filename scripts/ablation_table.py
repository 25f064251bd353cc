"""The ablation table of `scripts/train_ablation.sh`: for every run, the final training loss (mean of the last 5 logged
values) and the acceptance measured at its last evaluation (τ and first-token acceptance per EVAL set), as Markdown.

    python scripts/ablation_table.py outputs/ablation
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

RUNS = {  # run folder -> what it changes against the DFly reference
    "dfly": "DFly (reference: per-layer fusion + AR head, CE + KL, anchors redrawn)",
    "dflash": "DFlash (no fusion, no AR head)",
    "dfly-noar": "DFly without its AR head",
    "dfly-nofusion": "DFly without per-layer fusion",
    "dfly-ce": "DFly, hard-label CE only",
    "dfly-fixed": "DFly, the same anchors every epoch",
}


def summarise(run: Path) -> dict | None:
    state = run / "trainer_state.json"
    if not state.exists():  # unfinished: the newest checkpoint's state
        states = sorted(run.glob("checkpoint-*/trainer_state.json"), key=lambda p: int(p.parent.name.split("-")[1]))
        if not states:
            return None
        state = states[-1]
    history = json.loads(state.read_text())["log_history"]
    losses = [h["loss"] for h in history if "loss" in h]
    evals = [h for h in history if any(k.startswith("tau/") for k in h)]
    return {"step": max((h.get("step", 0) for h in history), default=0),
            "loss": sum(losses[-5:]) / len(losses[-5:]) if losses else float("nan"),
            "eval": evals[-1] if evals else {}}


def main(out: str) -> int:
    rows = {name: summarise(Path(out) / name) for name in RUNS}
    sets = sorted({k.split("/", 1)[1] for r in rows.values() if r for k in r["eval"] if k.startswith("tau/")})
    head = ["run", "steps", "final loss"] + [f"τ {s}" for s in sets] + [f"first-token {s}" for s in sets]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for name, row in rows.items():
        if row is None:
            print(f"| {RUNS[name]} | not run |" + " |" * (len(head) - 2))
            continue
        ev = row["eval"]
        cells = [RUNS[name], str(row["step"]), f"{row['loss']:.3f}"]
        cells += [f"{ev[f'tau/{s}']:.2f}" if f"tau/{s}" in ev else "–" for s in sets]
        cells += [f"{ev[f'first/{s}']:.2f}" if f"first/{s}" in ev else "–" for s in sets]
        print("| " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "outputs/ablation"))
