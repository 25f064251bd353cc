"""The GPU playbook's training results: recorded on the machine, packed into what `$OUT` returns, received here.

On the machine (`scripts/gpu/playbook.sh` calls these; stdlib only):

    python3 scripts/gpu/results.py source RUN_DIR          # the run's final drafter, else its last complete checkpoint
    python3 scripts/gpu/results.py period INIT_DIR dfly dflash mtp   # this run's period: 1 + the most recorded before
    python3 scripts/gpu/results.py steps SHIPPED_DIR       # the steps the period's run of a shipped folder made
    python3 scripts/gpu/results.py schedule-steps SHIPPED_DIR   # its learning-rate schedule's length (DFlash's)
    python3 scripts/gpu/results.py record FAMILY ...       # `gpu_training.json` beside a shipped folder (below)
    python3 scripts/gpu/results.py pack-out SHIP_ROOT OUT  # every shipped folder, one tar.gz in pieces under OUT

`record` writes `<family>-gpu/gpu_training.json`: one entry per GPU period this drafter has had (device, where it
started, steps, batch, anchors, blocks seen, seconds, what stopped it, the held-out τ the trainer logged as
`tau/held_out` with the blocks seen at each point) and the cumulative totals. A period that starts from a previous GPU
result (`stage.py pack --init-from`) reads that result's `gpu_training.json` and continues its list, so the totals
cover every period.

`pack-out` tars the shipped folders (gzip level 1: fp16 weights shrink by ~8%) and splits the tar in 15 MiB pieces
`train.tar.gz.000`, ... (16 MiB less 64 KiB where that saves a file), rewriting them after each family, and says
loudly when the files under `$OUT` would outnumber what the device returns (8).

Here: `python scripts/gpu/stage.py receive <returned folder>` (`receive` below) joins the pieces, unpacks the drafters
under `outputs/gpu-train/period-<k>/`, copies the other returned files beside them, and prints what to run next.
See docs/gpu.md.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import shutil
import sys
import tarfile
import time
from pathlib import Path

MIB = 1 << 20
FAMILIES = ("dfly", "dflash", "mtp")  # the order the playbook trains them in (DFlash matches DFly's steps)
SHIPPED = {family: f"drafters/smollm2-135m-instruct-{family}" for family in FAMILIES}
RECORD = "gpu_training.json"
PIECES = "train.tar.gz"
PIECE_BYTES = 15 * MIB
MAX_PIECE_BYTES = 16 * MIB - 64 * 1024  # the device returns files of <= 16 MiB
MAX_FILES = 8  # the device returns at most 8 files from $OUT
HELD_OUT_SETS = {"dfly": "gsm8k,gpteacher_codegen", "dflash": "gsm8k,gpteacher_codegen", "mtp": "sharegpt,alpaca"}


def shipped_blocks() -> dict[str, int]:
    """Blocks each shipped drafter had seen before any GPU period: its config's `training_blocks` (which every run
    keeps cumulative; `receive --blocks-before FAMILY=N` overrides it)."""
    found = {}
    for family, folder in SHIPPED.items():
        path = Path(__file__).resolve().parents[2] / folder / "config.json"
        blocks = json.loads(path.read_text()).get("training_blocks") if path.is_file() else None
        if blocks:
            found[family] = int(blocks)
    return found


def recorded_ends(folder, blocks_before: int) -> int:
    """How many pieces' ends before `blocks_before` a drafter folder's config records (`held_out_tau_ends`, which
    every training run extends)."""
    path = Path(folder) / "config.json"
    ends = (json.loads(path.read_text()).get("held_out_tau_ends") or []) if path.is_file() else []
    return sum(1 for end in ends if end["blocks"] <= blocks_before)


class ResultError(RuntimeError):
    """A run or a returned folder that cannot be used (the message says why)."""


# ----------------------------------------------------------------------------------------------- on the machine
def run_source(run_dir) -> Path | None:
    """The run's final drafter (`RUN_DIR/model.safetensors`), else its newest checkpoint that was fully written (one
    with `trainer_state.json`: a run killed at its budget), else None."""
    run_dir = Path(run_dir)
    if (run_dir / "model.safetensors").is_file():
        return run_dir
    done = [p.parent for p in run_dir.glob("checkpoint-*/trainer_state.json") if (p.parent / "model.safetensors").is_file()]
    return max(done, key=lambda p: int(p.name.split("-")[-1])) if done else None


def read_record(folder) -> dict | None:
    path = Path(folder) / RECORD
    return json.loads(path.read_text()) if path.is_file() else None


def run_period(init_dir, families) -> int:
    """1 + the most GPU periods any of `families`' previous results under `init_dir` (`<family>-gpu/`) recorded."""
    before = [len(rec["periods"]) for f in families if (rec := read_record(Path(init_dir) / f"{f}-gpu"))]
    return 1 + max(before, default=0)


def held_out_points(log_history: list[dict], key: str = "tau/held_out") -> list[dict]:
    """`[{"step", "blocks", "tau", "first"}]` for each logged `key`, in step order (one per step)."""
    points = {}
    for entry in log_history:
        if key in entry:
            first = entry.get(key.replace("tau/", "first/"))
            points[entry["step"]] = {"step": entry["step"], "blocks": entry.get("blocks"), "tau": round(entry[key], 4),
                                     "first": round(first, 4) if first is not None else None}
    return [points[s] for s in sorted(points)]


def blocks_seen(state: dict) -> int:
    """Training blocks the run saw: the trainer's own count (`BlocksSeen`, kept in the state), else the largest
    logged `blocks`."""
    saved = state.get("stateful_callbacks", {}).get("BlocksSeen")
    if saved:
        return int(saved["attributes"]["count"])
    return max((int(e["blocks"]) for e in state.get("log_history", []) if "blocks" in e), default=0)


def schedule_steps(state: dict) -> int | None:
    """The learning-rate schedule's length a run fitted to its time budget (`--fit_schedule_to_time`), if it did."""
    saved = state.get("stateful_callbacks", {}).get("FittedSchedule")
    return int(saved["attributes"]["steps"]) if saved and saved["attributes"].get("steps") else None


def make_record(family: str, state: dict, previous: dict | None, *, init: str, source: str, device: str, batch: int,
                anchors: int | None, max_steps: int, seed: int, wall_seconds: float, stop_at_step: int | None = None,
                train_args: str = "") -> dict:
    """The drafter's `gpu_training.json` after this period: `previous`'s periods (None: the first GPU period) plus
    this one, and the totals."""
    history = state.get("log_history", [])
    steps = int(state.get("global_step", 0))
    runtime = next((e["train_runtime"] for e in reversed(history) if "train_runtime" in e), None)
    if source != "final":
        stopped = f"killed at its time budget: the last checkpoint ({source}) shipped"
    elif stop_at_step and steps >= stop_at_step:
        stopped = f"stop_at_step {stop_at_step}"
    elif schedule_steps(state) and steps >= schedule_steps(state):
        stopped = f"the end of its schedule, fitted to the time budget (step {schedule_steps(state)})"
    elif steps >= max_steps:
        stopped = "max_steps"
    else:
        stopped = "max_train_seconds"
    blocks = blocks_seen(state)  # MTP: positions whose unrolled chain has a supervised prediction
    losses = [e for e in history if "loss" in e]
    period = {
        "period": len(previous["periods"]) + 1 if previous else 1, "device": device,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "init": init, "seed": seed,
        "steps": steps, "max_steps": max_steps, "schedule_steps": schedule_steps(state) or max_steps,
        "batch": batch, "anchors": anchors,
        "sequences": steps * batch, "blocks": blocks,
        "nominal_blocks": steps * batch * anchors if anchors else None,
        "train_seconds": round(runtime, 1) if runtime is not None else None, "wall_seconds": round(wall_seconds),
        "stopped": stopped, "source": source,
        "loss_first": losses[0]["loss"] if losses else None, "loss_last": losses[-1]["loss"] if losses else None,
        "tau_held_out": held_out_points(history),
        "train_args": train_args,
    }
    if stop_at_step:
        period["equal_budget_with_dfly"] = {"dfly_steps": stop_at_step, "matched": steps == stop_at_step}
    periods = [*(previous["periods"] if previous else []), period]

    def total(key):
        values = [p[key] for p in periods]
        return None if any(v is None for v in values) else sum(values)

    return {"about": "scripts/gpu/playbook.sh train: this drafter's GPU training periods and their totals",
            "family": family, "shipped_start": previous["shipped_start"] if previous else init,
            "periods": periods,
            "cumulative": {"periods": len(periods), "steps": total("steps"), "sequences": total("sequences"),
                           "blocks": total("blocks"), "train_seconds": total("train_seconds")}}


def summary_line(record: dict) -> str:
    p, c = record["periods"][-1], record["cumulative"]
    taus = p["tau_held_out"]
    tau = f"held-out τ {taus[0]['tau']:.3f} -> {taus[-1]['tau']:.3f}" if taus else "no held-out τ logged"
    blocks = f", {p['blocks']:,} blocks" if p["blocks"] is not None else ""
    cum_blocks = f", {c['blocks']:,} blocks" if c["blocks"] is not None else ""
    loss = (f"; loss {p['loss_first']:.4f} -> {p['loss_last']:.4f}" if p["loss_first"] is not None else "")
    equal = ""
    if "equal_budget_with_dfly" in p:
        e = p["equal_budget_with_dfly"]
        equal = ("; at equal budget with DFly" if e["matched"] else
                 f"; NOT at equal budget: DFly made {e['dfly_steps']} steps, this run {p['steps']}")
    schedule = f" (a schedule of {p['schedule_steps']})" if p.get("schedule_steps") else ""
    return (f"{record['family']}: GPU period {p['period']} ({p['device']}): {p['steps']} steps{schedule} of {p['batch']}"
            f"{blocks}, {p['train_seconds']} s of training, stopped by {p['stopped']}; {tau}{loss}{equal}; "
            f"all GPU periods: {c['steps']} steps{cum_blocks}")


def cmd_record(args) -> int:
    run_dir, ship_dir = Path(args.run_dir), Path(args.ship_dir)
    src = run_source(run_dir)
    if src is None:
        raise ResultError(f"{run_dir}: no final drafter and no complete checkpoint")
    state = json.loads((src / "trainer_state.json").read_text())
    previous = read_record(args.init) if args.init and Path(args.init).is_dir() else None
    record = make_record(args.family, state, previous, init=args.init_label or str(args.init), device=args.device,
                         source="final" if src == run_dir else src.name, batch=args.batch, anchors=args.anchors,
                         max_steps=args.max_steps, seed=args.seed, wall_seconds=args.wall_seconds,
                         stop_at_step=args.stop_at_step, train_args=args.train_args)
    shutil.copy(src / "trainer_state.json", ship_dir / "trainer_state.json")
    (ship_dir / "SOURCE.txt").write_text(f"from: {src}\n")
    (ship_dir / RECORD).write_text(json.dumps(record, indent=1) + "\n")
    print(summary_line(record))
    return 0


def write_pieces(ship_root, out, piece_bytes: int = PIECE_BYTES, max_files: int = MAX_FILES,
                 max_piece_bytes: int = MAX_PIECE_BYTES) -> list[Path]:
    """Every folder under `ship_root` in one tar.gz, split into `out/train.tar.gz.NNN` (old pieces removed first).
    Pieces of `piece_bytes`, or of `max_piece_bytes` when only those fit the files left of `max_files`; prints a loud
    warning when the files under `out` would still outnumber `max_files`."""
    ship_root, out = Path(ship_root), Path(out)
    for old in out.glob("train.tar*"):
        old.unlink()
    blob = ship_root.parent / f"{PIECES}.tmp"
    with tarfile.open(blob, "w:gz", compresslevel=1) as tar:
        for folder in sorted(p for p in ship_root.iterdir() if p.is_dir()):
            tar.add(folder, arcname=folder.name)
    size = blob.stat().st_size
    others = [p for p in out.iterdir() if p.is_file()]
    slots = max_files - len(others)
    if math.ceil(size / piece_bytes) > slots and math.ceil(size / max_piece_bytes) <= slots:
        piece_bytes = max_piece_bytes
    pieces = []
    with open(blob, "rb") as f:
        while block := f.read(piece_bytes):
            path = out / f"{PIECES}.{len(pieces):03d}"
            path.write_bytes(block)
            pieces.append(path)
    blob.unlink()
    if len(others) + len(pieces) > max_files:
        print(f"!!! WARNING: {len(others) + len(pieces)} files under {out} ({len(pieces)} train pieces of "
              f"{size / MIB:.1f} MiB, plus {', '.join(p.name for p in others)}): the device returns at most "
              f"{max_files}. The playbook folds the text logs into logs.tar.gz at its end; if it is cut short, some "
              "pieces do not come back. Train fewer families in one call.", flush=True)
    return pieces


def cmd_pack_out(args) -> int:
    pieces = write_pieces(args.ship_root, args.out)
    print(f"{len(pieces)} piece(s): {' '.join(f'{p.name} ({p.stat().st_size / MIB:.1f} MiB)' for p in pieces)}")
    return 0


def fold_logs(out, names=("gpu_tests.txt", "bench.log", "train.log"), max_files: int = MAX_FILES) -> list[str]:
    """When the files under `out` outnumber `max_files`, the text logs `names` go into `out/logs.tar.gz` (the
    playbook's last step). Returns the names folded."""
    out = Path(out)
    files = [p for p in out.iterdir() if p.is_file()]
    present = [out / n for n in names if (out / n).is_file()]
    if len(files) <= max_files or not present:
        return []
    with tarfile.open(out / "logs.tar.gz", "w:gz") as tar:
        for path in present:
            tar.add(path, arcname=path.name)
    for path in present:
        path.unlink()
    return [p.name for p in present]


# ----------------------------------------------------------------------------------------------------- here
def join_pieces(folder, dest_file) -> list[Path]:
    """`train.tar.gz.000`, `.001`, ... of `folder` joined into `dest_file`; raises when one is missing."""
    pieces = sorted(p for p in Path(folder).iterdir() if re.fullmatch(r"train\.tar(\.gz)?\.\d{3}", p.name))
    if not pieces:
        return []
    names = [p.name for p in pieces]
    stem = names[0].rsplit(".", 1)[0]
    expected = [f"{stem}.{i:03d}" for i in range(len(pieces))]
    if names != expected:
        missing = sorted(set(expected) - set(names)) or [f"{stem}.{len(pieces):03d}..."]
        raise ResultError(f"{folder}: the pieces are {names}, not consecutive from .000: missing {missing} (did the "
                          "device leave files out? see the reply's files_left_out)")
    with open(dest_file, "wb") as g:
        for p in pieces:
            with open(p, "rb") as f:
                shutil.copyfileobj(f, g, 8 * MIB)
    return pieces


def next_steps(period_dir: Path, records: dict[str, dict], blocks_before: dict[str, int]) -> str:
    """What to run after receiving: compare, draw, ship, and the next GPU period."""
    rel = period_dir.as_posix()
    lines = []
    for family, record in records.items():
        last, cum = record["periods"][-1], record["cumulative"]
        lines.append(summary_line(record))
        folder = f"{rel}/{family}-gpu"
        sets = HELD_OUT_SETS[family]
        lines.append(f"  compare with the shipped drafter on the 12 held-out TRAIN prompts (steps: on GPUs):\n"
                     f"    python scripts/tau_by_training.py --sets {sets} --out {rel}/tau-{family} "
                     f"\"shipped:0:{SHIPPED[family]}\" \"GPU period {last['period']}:{cum['steps']}:{folder}\"")
        base = blocks_before.get(family, 0)
        before = base + sum(p["blocks"] or 0 for p in record["periods"][:-1])
        earlier = []
        at = base
        for p in record["periods"][:-1]:
            at += p["blocks"] or 0
            if p["tau_held_out"]:
                earlier.append(f" --earlier \"GPU period {p['period']}:{at}:{p['tau_held_out'][-1]['tau']}\"")
        note = "" if family in blocks_before else (f" (add the blocks the shipped {family} had seen: receive "
                                                    f"--blocks-before {family}=N)")
        sets_flag = f" --sets {sets}" if family == "mtp" else ""
        # where the drafter's config records two or more earlier pieces' ends (`held_out_tau_ends`: the CPU rounds'
        # and earlier periods') and this period logged its own, the curve is fitted through them, as the shipped
        # card's is; with fewer, over every logged point, the earlier periods' ends drawn beside
        fitted = last["tau_held_out"] and recorded_ends(period_dir / f"{family}-gpu", before) >= 2
        fit = " --fit-ends" if fitted else "".join(earlier)
        lines.append(f"  held-out τ against training blocks (the τ-against-compute curve){note}:\n"
                     f"    python scripts/tau_by_training.py --from-logs {folder} --blocks-before {before}"
                     f"{fit}{sets_flag} --out {rel}/tau-compute-{family}")
        full = " --full-vocab" if family == "dflash" else ""
        lines.append(f"  ship it (then the two commits of docs/contributing.md, \"Shipping new weights\"):\n"
                     f"    python -m angelspec_hf.ship {folder} {SHIPPED[family]}{full}")
    sources = [rel] + [f.as_posix() for f in older_results(period_dir, set(records))]
    lines.append(f"the next GPU period starts from these: python scripts/gpu/stage.py pack --init-from "
                 f"{' '.join(sources)}")
    return "\n".join(lines)


def older_results(period_dir: Path, have: set[str]) -> list[Path]:
    """The other period folders beside `period_dir` that hold the most trained result of a family missing from
    `have` (a family this period did not train continues from its own last period)."""
    best: dict[str, tuple[int, Path]] = {}
    for folder in sorted(period_dir.parent.glob("period-*")):
        if folder == period_dir:
            continue
        for family in FAMILIES:
            record = read_record(folder / f"{family}-gpu")
            if family not in have and record and len(record["periods"]) >= best.get(family, (0, None))[0]:
                best[family] = (len(record["periods"]), folder)
    return sorted({folder for _, folder in best.values()})


def receive(returned, dest_root="outputs/gpu-train", blocks_before: dict[str, int] | None = None,
            force: bool = False) -> tuple[Path, str]:
    """Unpack what a playbook call returned (`returned`: the reply's `files_at`) under `dest_root/period-<k>/`: the
    drafters (`<family>-gpu/`) and, in `returned/`, every other file. Returns the folder and what to run next."""
    returned, dest_root = Path(returned), Path(dest_root)
    blocks_before = shipped_blocks() | (blocks_before or {})
    if not returned.is_dir():
        raise ResultError(f"{returned} is not a folder (give the reply's files_at)")
    dest_root.mkdir(parents=True, exist_ok=True)
    incoming = dest_root / ".incoming"
    shutil.rmtree(incoming, ignore_errors=True)
    incoming.mkdir()
    joined = dest_root / ".train.tar.gz"
    pieces = join_pieces(returned, joined)
    records = {}
    if pieces:
        with tarfile.open(joined, "r:*") as tar:
            tar.extractall(incoming, filter="data")
        joined.unlink()
        for family in FAMILIES:
            record = read_record(incoming / f"{family}-gpu")
            if record:
                records[family] = record
    if records:
        name = f"period-{max(len(r['periods']) for r in records.values())}"
    else:
        name = "returned-" + time.strftime("%Y%m%d-%H%M%S")
    final = dest_root / name
    if final.exists():
        if not force:
            shutil.rmtree(incoming)
            raise ResultError(f"{final} exists: receive into another --dest, or --force to replace it")
        shutil.rmtree(final)
    kept = incoming / "returned"
    kept.mkdir()
    for path in returned.iterdir():
        if path.is_file() and path not in pieces:
            shutil.copy2(path, kept / path.name)
    incoming.rename(final)
    if not records:
        return final, f"no trained drafter came back (no {PIECES}.* pieces); the returned files are in {kept}"
    return final, next_steps(final, records, blocks_before)


def parse_blocks_before(items) -> dict[str, int]:
    out = {}
    for item in items or []:
        family, sep, n = item.partition("=")
        if not sep or family not in FAMILIES or not n.isdigit():
            raise ResultError(f"--blocks-before takes FAMILY=N with FAMILY one of {FAMILIES}, got {item!r}")
        out[family] = int(n)
    return out


def cmd_receive(args) -> int:
    final, text = receive(args.returned, args.dest, parse_blocks_before(args.blocks_before), args.force)
    print(f"received into {final}")
    print(text)
    return 0


def add_receive_arguments(p) -> None:
    p.add_argument("returned", help="the folder the device returned (the reply's files_at)")
    p.add_argument("--dest", default="outputs/gpu-train", help="the drafters go to DEST/period-<k>/ (git-ignored)")
    p.add_argument("--blocks-before", action="append", default=[], metavar="FAMILY=N",
                   help="blocks the shipped drafter had seen before any GPU period (default: its config's "
                        "training_blocks)")
    p.add_argument("--force", action="store_true", help="replace DEST/period-<k> when it exists")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("source", help="the run's final drafter, else its last complete checkpoint")
    p.add_argument("run_dir")
    p.set_defaults(func=lambda a: print(run_source(a.run_dir) or "") or 0)
    p = sub.add_parser("period", help="this run's GPU period: 1 + the most the previous results recorded")
    p.add_argument("init_dir")
    p.add_argument("families", nargs="+")
    p.set_defaults(func=lambda a: print(run_period(a.init_dir, a.families)) or 0)
    p = sub.add_parser("steps", help="the steps of the last period recorded in a shipped folder")
    p.add_argument("ship_dir")
    p.set_defaults(func=lambda a: print(read_record(a.ship_dir)["periods"][-1]["steps"]) or 0)
    p = sub.add_parser("schedule-steps", help="the length of the learning-rate schedule of the last period recorded "
                                              "in a shipped folder (fitted to its time budget, else max_steps)")
    p.add_argument("ship_dir")
    p.set_defaults(func=lambda a: print(read_record(a.ship_dir)["periods"][-1]["schedule_steps"]) or 0)
    p = sub.add_parser("record", help=f"write {RECORD} into a shipped folder")
    p.add_argument("family", choices=FAMILIES)
    p.add_argument("--run-dir", required=True)
    p.add_argument("--ship-dir", required=True)
    p.add_argument("--init", default="", help="the folder the run started from (a previous result continues its "
                                              "record)")
    p.add_argument("--init-label", default=None)
    p.add_argument("--device", default="unknown")
    p.add_argument("--batch", type=int, required=True)
    p.add_argument("--anchors", type=int, default=None)
    p.add_argument("--max-steps", type=int, required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--stop-at-step", type=int, default=None)
    p.add_argument("--wall-seconds", type=float, default=0.0)
    p.add_argument("--train-args", default="")
    p.set_defaults(func=cmd_record)
    p = sub.add_parser("pack-out", help="the shipped folders as one tar.gz in pieces under OUT")
    p.add_argument("ship_root")
    p.add_argument("out")
    p.set_defaults(func=cmd_pack_out)
    p = sub.add_parser("fold-logs", help="the text logs into logs.tar.gz when OUT holds more than 8 files")
    p.add_argument("out")
    p.set_defaults(func=lambda a: print(" ".join(fold_logs(a.out))) or 0)
    p = sub.add_parser("receive", help="here: unpack what the device returned, print what to run next")
    add_receive_arguments(p)
    p.set_defaults(func=cmd_receive)
    args = ap.parse_args(argv)
    try:
        return args.func(args)
    except ResultError as error:
        print(f"results.py {args.cmd}: {error}")
        return 1


if __name__ == "__main__":
    sys.exit(main())
