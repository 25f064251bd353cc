"""Held-out τ of a drafter against the training it has had, and how much more training a τ goal would take.

Each checkpoint is `label:steps:source`, where steps is the cumulative optimiser steps behind it and source a drafter
folder or `git:<rev>:<path>` (a drafter committed at that revision, e.g. an earlier shipped round). Every checkpoint
drafts for the same prompts with the same target: greedy, whole blocks, no n-gram lookups (the drafter alone), 64 new
tokens, on held-out TRAIN prompts that were never regenerated (`tune_stop_threshold.held_out_prompts`, never EVAL).

    python scripts/tau_by_training.py --out outputs/tau-by-training \\
        "round 1:800:git:7752a0e:drafters/smollm2-135m-instruct-dfly" ... "round 5:4400:git:4ff40e8:drafters/smollm2-135m-instruct-dfly"

Writes `tau_by_training.json` and `tau_by_training.png` (τ and first-token acceptance against cumulative steps). Every
checkpoint after the first is also compared with the first on the same prompts: its τ ratio with a 95% interval from
a paired bootstrap over prompts (`vs_first`; a drafter ships only where the low end is above 1).

With `--from-logs RUN_DIR`, nothing is measured: the held-out τ a training run logged (`--eval_prompts_from held_out`,
the same prompts, logged as `tau/held_out` with the `blocks` seen so far) is read from the newest `trainer_state.json`
of the run (its own, or its newest checkpoint's), drawn against training blocks seen, and extrapolated to τ 3 and 4
by a least-squares fit τ = a + b·ln(blocks); the blocks needed are converted to CPU hours at the run's median logged
`blocks_per_second`. `--blocks-before` adds the blocks the starting drafter had already seen (its config's
`training_blocks`: the shipped DFly 8,648,078; round 5, 4,400 steps of 4 sequences × 64 anchors = 1,126,400).
Several run folders, each run continuing the previous one's final drafter (`INIT=<previous>/dfly`), are read as one
run and fitted together.

    python scripts/tau_by_training.py --from-logs outputs/cpu-train/dfly --blocks-before 8648078 \
        --out outputs/tau-by-training          # writes tau_by_compute.json and tau_by_compute.png
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import angelspec_hf  # noqa: E402
from angelspec_hf.shipped import drafter_for_target  # noqa: E402
from angelspec_hf.trainer.compute_curve import (  # noqa: E402,F401 (blocks_for, fit_log_curve: for the tests)
    SETTINGS, blocks_for, curve, fit_log_curve, plot_compute)
from angelspec_hf.trainer.evaluation import measure_acceptance, paired_tau_ratio  # noqa: E402
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
    ax.axhline(3.0, color="grey", lw=0.8, ls=":", label="τ 3.0")
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


def newest_state(run_dir) -> dict:
    """The `trainer_state.json` with the most steps among a run folder's own and its checkpoints'."""
    candidates = [Path(run_dir) / "trainer_state.json", *Path(run_dir).glob("checkpoint-*/trainer_state.json")]
    states = [json.loads(p.read_text()) for p in candidates if p.is_file()]
    if not states:
        raise FileNotFoundError(f"no trainer_state.json in {run_dir} or its checkpoint-* folders (the run writes one "
                                "at its first save_steps)")
    return max(states, key=lambda state: state.get("global_step", 0))


def parse_earlier(spec: str) -> dict:
    """`label:blocks:tau` → a point of an earlier round."""
    label, blocks, tau = spec.rsplit(":", 2)
    return {"label": label, "blocks": int(blocks), "tau": float(tau)}


def chained_history(run_dirs, key: str = "tau/held_out") -> list[dict]:
    """The logs of runs that each continued the previous one's final drafter, as one run's: a later run's steps and
    blocks counted on from the end of the runs before it (its step count, and the blocks it saw: its `BlocksSeen`
    callback's count, else its largest logged `blocks`). A later run's start-of-run `key` (step 0: the drafter the run
    before it ended with, measured again) is left out where the run before it logged `key` at its end; a start that
    reads more than 0.02 away from that end is reported, since the later run may not have started from it."""
    history, steps, blocks, last = [], 0, 0, None
    for i, run_dir in enumerate(run_dirs):
        state = newest_state(run_dir)
        log = state["log_history"]
        for entry in log:
            if i and key in entry and entry.get("step") == 0 and last is not None:
                if abs(entry[key] - last[key]) > 0.02:
                    print(f"warning: {run_dir} starts at {key} {entry[key]:.3f}, the run before it ended at "
                          f"{last[key]:.3f}: did it start from that run's final drafter?", file=sys.stderr)
                continue
            entry = dict(entry, step=entry.get("step", 0) + steps)
            if "blocks" in entry:
                entry["blocks"] += blocks
            history.append(entry)
        seen = (state.get("stateful_callbacks", {}).get("BlocksSeen", {}).get("attributes", {}).get("count")
                or max((entry["blocks"] for entry in log if "blocks" in entry), default=0))
        if not seen and i < len(run_dirs) - 1:
            raise ValueError(f"{run_dir} logged no `blocks`: the runs after it cannot be placed on the blocks axis")
        steps += state.get("global_step", 0)
        blocks += seen
        ends = [entry for entry in history if key in entry and entry.get("blocks") == blocks]
        last = ends[-1] if ends else None
        if last is not None:
            last["run_end"] = True  # the piece's annealed end (`--fit-ends`)
    return history


def run_ends(history: list[dict], blocks_before: int, key: str = "tau/held_out") -> list[dict]:
    """The end of each chained run (its last logged `key`, at the blocks it ended with) as `{"step", "blocks",
    "tau"}`: where each piece's learning rate had decayed."""
    return [{"step": e["step"], "blocks": e["blocks"] + blocks_before, "tau": e[key]}
            for e in history if e.get("run_end") and key in e]


def recorded_ends(run_dir, blocks_before: int) -> list[dict]:
    """Where the pieces before a run ended, as its config records them (`held_out_tau_ends`, written by every
    training run: the starting drafter's list and its own end), those at or before `blocks_before` (the run's start)
    and measured as the list's last end was (the same prompts and new tokens), labelled `piece N`; the run's own
    folder's config, else its newest checkpoint's. Empty when the config has none."""
    checkpoints = [p for p in Path(run_dir).glob("checkpoint-*/config.json")
                   if re.fullmatch(r"checkpoint-\d+", p.parent.name)]
    configs = [Path(run_dir) / "config.json",
               *sorted(checkpoints, key=lambda p: -int(p.parent.name.split("-")[-1]))]
    for path in configs:
        if path.is_file():
            ends = json.loads(path.read_text()).get("held_out_tau_ends") or []
            if not ends:
                return []
            settings = {k: ends[-1][k] for k in SETTINGS if k in ends[-1]}
            return [{"label": f"piece {i + 1}", "blocks": int(e["blocks"]), "tau": float(e["tau"])}
                    for i, e in enumerate(ends)
                    if e["blocks"] <= blocks_before and all(e.get(k) == v for k, v in settings.items())]
    return []


def from_logs(run_dir, out: Path, blocks_before: int, key: str = "tau/held_out", earlier: list[dict] = (),
              compare: list[dict] = (), goals=(3.0, 4.0), fit_ends: bool = False, fitted: list[dict] = ()) -> dict:
    """`run_dir`: a run folder, or a list of them where each run continued the previous one's drafter (fitted as
    one curve, `chained_history`). `fit_ends`: fit only each run's end (`run_ends`) and the `fitted` points (the
    ends of earlier pieces; by default those the first run's config records, `recorded_ends`), not every logged
    point: the restart of each piece at its peak learning rate and the
    spread of a dozen prompts move the points inside a piece more than the training between pieces does."""
    runs = [run_dir] if isinstance(run_dir, (str, os.PathLike)) else list(run_dir)
    history = chained_history(runs, key)
    if fitted and not fit_ends:
        raise ValueError("`fitted` points (earlier pieces' ends) are fitted with the runs' ends: use them with fit_ends")
    points = None
    if fit_ends and not fitted:  # the earlier pieces' ends the first run's config records
        fitted = recorded_ends(runs[0], blocks_before)
        if fitted:
            print(f"fitting with the {len(fitted)} earlier pieces' ends {runs[0]}'s config records "
                  "(held_out_tau_ends)", file=sys.stderr)
    if fit_ends:
        ends = run_ends(history, blocks_before, key)
        if len(ends) < len(runs):
            print(f"warning: {len(runs) - len(ends)} of the runs logged no {key} at their last step: left out of the "
                  "fit of the pieces' ends", file=sys.stderr)
        points = [*fitted, *ends]
        if len({p["blocks"] for p in points}) < 2:
            raise ValueError(f"--fit-ends: {len(points)} end(s) to fit; give earlier pieces' ends with --fitted")
    found = curve(history, blocks_before, key, goals, fit_points=points)
    if found is None:
        raise ValueError(f"{', '.join(map(str, runs))} logged {key} at fewer than two different block counts: "
                         "nothing to fit")
    rows, rate = found["rows"], found["blocks_per_second"]
    fit_over = "the pieces' ends" if fit_ends else ""
    fit = (found["fit"]["a"], found["fit"]["b"])
    goals = {float(t): g["blocks"] for t, g in found["goals"].items()}
    result = {"run": ", ".join(map(str, runs)), **found, "earlier": list(earlier), "fitted": list(fitted),
              "compare": list(compare),
              "goals": {t: {"blocks": g["blocks"], "cpu_hours": g["hours"]} for t, g in found["goals"].items()}}
    out.mkdir(parents=True, exist_ok=True)
    (out / "tau_by_compute.json").write_text(json.dumps(result, indent=1))
    plot_compute(rows, fit, goals, out / "tau_by_compute.png", rate, list(earlier), list(compare), list(fitted),
                 fit_over)
    for r in rows:
        print(f"step {r['step']:>6}  blocks {r['blocks']:>10,}  τ {r['tau']:.3f}")
    print(f"fit{' over ' + str(len(found['fit']['points'])) + ' points' if 'points' in found['fit'] else ''}: "
          f"τ = {fit[0]:.3f} + {fit[1]:.4f}·ln(blocks); run speed {rate} blocks/s (median logged)")
    for tau, x in goals.items():
        hours = f" = {x / rate / 3600:,.0f} CPU hours at that speed" if x and rate else ""
        print(f"τ {tau}: {'not reached by the fit' if x is None else f'{x:,.0f} blocks{hours}'}")
    print(f"wrote {out / 'tau_by_compute.json'}, {out / 'tau_by_compute.png'}")
    return result


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
    parser.add_argument("--from-logs", metavar="RUN_DIR", nargs="+", help="read the held-out τ a training run "
                        "logged; measure nothing. Several runs, each continuing the previous one's final drafter, "
                        "are read as one (blocks and steps counted on) and fitted together")
    parser.add_argument("--blocks-before", type=int, default=0,
                        help="with --from-logs: blocks the run's starting drafter had already seen")
    parser.add_argument("--log-key", default="tau/held_out", help="with --from-logs: the logged τ to read")
    parser.add_argument("--earlier", action="append", default=[], metavar="LABEL:BLOCKS:TAU",
                        help="with --from-logs: an earlier round's held-out τ at its blocks seen, drawn beside the "
                             "run's points (not fitted); repeatable")
    parser.add_argument("--compare", action="append", default=[], metavar="LABEL:BLOCKS:TAU",
                        help="with --from-logs: another drafter's held-out τ on the same prompts (e.g. the DFlash "
                             "baseline at its blocks seen), drawn apart from the run (not fitted); repeatable")
    parser.add_argument("--fitted", action="append", default=[], metavar="LABEL:BLOCKS:TAU",
                        help="with --fit-ends: where an earlier piece of training ended (held-out τ at its blocks "
                             "seen), drawn and fitted with the runs' ends; repeatable (default: the ends the first "
                             "run's config records, held_out_tau_ends)")
    parser.add_argument("--fit-ends", action="store_true",
                        help="with --from-logs: fit each run's last logged τ (where its learning rate had decayed) "
                             "and the --fitted points, not every logged point")
    parser.add_argument("--goals", default="3,4", help="with --from-logs: the τ values the fit is extended to "
                        "(comma-separated; e.g. 2,3 for MTP)")
    args = parser.parse_args(argv)
    if args.from_logs:
        if args.fitted and not args.fit_ends:
            parser.error("--fitted gives earlier pieces' ends to the fit of --fit-ends: add --fit-ends")
        from_logs(args.from_logs, Path(args.out), args.blocks_before, args.log_key,
                  [parse_earlier(spec) for spec in args.earlier], [parse_earlier(spec) for spec in args.compare],
                  tuple(float(goal) for goal in args.goals.split(",")), args.fit_ends,
                  [parse_earlier(spec) for spec in args.fitted])
        return 0
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
            row = {"label": label, "steps": steps, "source": source, **r}
            against = ""
            if rows:  # paired with the first checkpoint, on the same prompts
                row["vs_first"] = paired_tau_ratio(rows[0]["per_prompt"], r["per_prompt"])
                against = (f"  τ {row['vs_first']['ratio']:.3f}x {rows[0]['label']}'s (95% "
                           f"{row['vs_first']['low']:.3f}-{row['vs_first']['high']:.3f}, paired over prompts)")
            rows.append(row)
            print(f"{label:>24}  steps {steps:>5}  τ {r['tau']:.3f}  first {r['first']:.3f}  ({r['rounds']} rounds)"
                  + against, flush=True)
    setting = {"sets": args.sets, "prompts": len(prompts), "max_new_tokens": args.max_new_tokens,
               "threads": args.threads, "decoding": "greedy, whole blocks, no lookups"}
    (out / "tau_by_training.json").write_text(json.dumps({"setting": setting, "rows": rows}, indent=1))
    plot(rows, out / "tau_by_training.png")
    print(f"wrote {out / 'tau_by_training.json'}, {out / 'tau_by_training.png'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
