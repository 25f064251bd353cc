"""`python -m angelspec_hf.ship RUN_DIR DEST [--full-vocab]`: a training run's final drafter → fp16 Hub layout in
DEST (safetensors, config, modeling code with `auto_map`, the run's model card, loss curve and lookup corpus).
`python -m angelspec_hf.ship --code FOLDER...` rewrites only the modeling code of shipped folders from the current
`modeling/` (what `save_pretrained` would write); weights and config stay as they are.

A folder's code is its family's configuration and modeling files with `drafter_utils.py` and `configuration_drafter.py`
(what `from_pretrained` needs to build the drafter and what `propose`/`draft` need to run it): the generate() hook
(`candidate_generator.py`, `draft_policy.py`) and the rest of `drafter_library.py` stay in the installed package,
which the folder's code imports only where a caller asks for them (`drafter_utils.library`).

In a checkout, `drafters/*/model.safetensors` are git-ignored: the shipped weights are git blobs listed in
`drafters/weights.json` (`angelspec_hf.weights_store`). Shipping into `drafters/<name>` prints the steps that record
the new weights there (docs/contributing.md)."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path


def ship(run_dir, dest, full_vocab: bool = False) -> Path:
    """`full_vocab`: drop a pruned draft vocabulary (e.g. so the drafter stays exportable to z-lab's DFlash layout
    and usable on transformers' built-in DFlash path, which apply the whole LM head)."""
    import torch

    import angelspec_hf

    drafter = angelspec_hf.load_drafter(str(run_dir)).to(torch.float16)
    if full_vocab:
        drafter.set_draft_vocab(None)
    dest = Path(dest)
    if dest.exists():
        shutil.rmtree(dest)
    drafter.save_pretrained(dest)
    # the run's model card, its plots and its lookup corpus
    for name in ("README.md", "loss_curve.png", "tau_by_compute.png", "lookup_corpus.safetensors"):
        if (Path(run_dir) / name).is_file():
            shutil.copy(Path(run_dir) / name, dest / name)
    return dest


def store_steps(dest) -> str | None:
    """What to run so that new weights written to `dest` ship: None unless `dest` sits beside a `weights.json`
    manifest (a checkout's `drafters/`), where the weights files are git-ignored and kept as git blobs."""
    from angelspec_hf.weights_store import MANIFEST

    dest = Path(dest)
    if not (dest.parent / MANIFEST).is_file():
        return None
    return (f"{dest}'s weights are git-ignored; to ship them: (1) `git add -f {dest}/*.safetensors` with the other "
            f"files and commit; (2) `python -m angelspec_hf.weights_store store {dest}`; (3) `git rm --cached "
            f"{dest}/*.safetensors`, `git add {dest.parent / MANIFEST}` and commit. Keep both commits in main's "
            "history (no squash): the manifest names the blobs of the first.")


def export_drafter_code(folder, out=None) -> list[Path]:
    """The modeling code `save_pretrained` writes for the drafter in `folder` (its `auto_map` classes), written to
    `out` (default: `folder`, replacing its `.py` files)."""
    import json

    from angelspec_hf.modeling import DRAFTERS
    from angelspec_hf.modeling.drafter_library import export_code

    model_type = json.loads((Path(folder) / "config.json").read_text())["model_type"]
    classes = next((pair for pair in DRAFTERS.values() if pair[0].model_type == model_type), None)
    if classes is None:
        raise ValueError(f"{folder}: model_type {model_type!r} is not an AngelSpec drafter")
    out = Path(out or folder)
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("*.py"):
        old.unlink()
    return sorted(set(export_code(classes[1], out) + export_code(classes[0], out)))


def main(argv=None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m angelspec_hf.ship", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("paths", nargs="+", metavar="PATH",
                        help="RUN_DIR DEST (ship a training run), or with --code the drafter folders to re-export")
    parser.add_argument("--code", action="store_true",
                        help="rewrite only the .py files of the given drafter folders from the current modeling/")
    parser.add_argument("--full-vocab", action="store_true",
                        help="drop a pruned draft vocabulary (keeps a DFlash drafter on transformers' DFlash path)")
    args = parser.parse_args(argv)
    if args.code:
        if args.full_vocab:
            parser.error("--full-vocab changes weights: ship the run again instead of --code")
        for folder in args.paths:
            print(folder, [p.name for p in export_drafter_code(folder)])
        return 0
    if len(args.paths) != 2:
        parser.error("shipping a run takes RUN_DIR DEST")
    print(ship(args.paths[0], args.paths[1], full_vocab=args.full_vocab))
    if steps := store_steps(args.paths[1]):
        print(steps)
    return 0


if __name__ == "__main__":
    sys.exit(main())
