"""`python -m angelspec_hf.ship RUN_DIR DEST`: a training run's final drafter → fp16 Hub layout in DEST (safetensors,
config, modeling code with `auto_map`, and the run's model card)."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path


def ship(run_dir, dest) -> Path:
    import torch

    import angelspec_hf

    drafter = angelspec_hf.load_drafter(str(run_dir)).to(torch.float16)
    dest = Path(dest)
    if dest.exists():
        shutil.rmtree(dest)
    drafter.save_pretrained(dest)
    card = Path(run_dir) / "README.md"
    if card.is_file():
        shutil.copy(card, dest / "README.md")
    return dest


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: python -m angelspec_hf.ship RUN_DIR DEST")
    print(ship(sys.argv[1], sys.argv[2]))
