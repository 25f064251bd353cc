"""`python -m angelspec_hf.ship RUN_DIR DEST [--full-vocab]`: a training run's final drafter → fp16 Hub layout in
DEST (safetensors, config, modeling code with `auto_map`, the run's model card and loss curve). `python -m angelspec_hf.ship --code FOLDER...`
rewrites only the modeling code of shipped folders from the current `modeling/` (what `save_pretrained` would write).

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
    for name in ("README.md", "loss_curve.png"):  # the run's model card and its loss curve
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
    from angelspec_hf.modeling.drafter_utils import export_code

    model_type = json.loads((Path(folder) / "config.json").read_text())["model_type"]
    classes = next((pair for pair in DRAFTERS.values() if pair[0].model_type == model_type), None)
    if classes is None:
        raise ValueError(f"{folder}: model_type {model_type!r} is not an AngelSpec drafter")
    out = Path(out or folder)
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("*.py"):
        old.unlink()
    return sorted(set(export_code(classes[1], out) + export_code(classes[0], out)))


if __name__ == "__main__":
    if len(sys.argv) >= 3 and sys.argv[1] == "--code":
        for folder in sys.argv[2:]:
            print(folder, [p.name for p in export_drafter_code(folder)])
    elif len(sys.argv) in (3, 4) and sys.argv[3:] in ([], ["--full-vocab"]):
        print(ship(sys.argv[1], sys.argv[2], full_vocab=sys.argv[3:] == ["--full-vocab"]))
        if steps := store_steps(sys.argv[2]):
            print(steps)
    else:
        sys.exit("usage: python -m angelspec_hf.ship RUN_DIR DEST [--full-vocab] | --code FOLDER...")
