"""The drafters shipped with the project for the embedded SmolLM2-135M-Instruct target (`drafters/`, Hub layout:
fp16 safetensors, config, modeling code, model card), and `python -m angelspec_hf.ship RUN DEST`, which writes a
training run's final weights into that layout."""

from __future__ import annotations

from pathlib import Path

SHIPPED_DIR = Path(__file__).resolve().parent.parent / "drafters"
SHIPPED_PREFIX = "smollm2-135m-instruct-"


def shipped_drafter_path(family: str) -> Path | None:
    """Folder of the shipped drafter of `family` ("mtp", "dflash", "dfly"), or None when it is not there."""
    path = SHIPPED_DIR / f"{SHIPPED_PREFIX}{family}"
    return path if (path / "config.json").is_file() else None


def shipped_or_untrained(family: str, target, dtype=None, why: list | None = None):
    """`(drafter, trained)`: the shipped drafter of `family` in the target's dtype, or a fresh untrained one when
    none ships or the shipped one was not made for `target` (they are the embedded SmolLM2-135M-Instruct's). The
    reason for an untrained one is appended to `why` when given."""
    import angelspec_hf
    from angelspec_hf.modeling import DRAFTERS

    path = shipped_drafter_path(family)
    if path is None:
        reason = f"no {family} drafter is shipped at {SHIPPED_DIR / (SHIPPED_PREFIX + family)}"
    else:
        drafter = angelspec_hf.load_drafter(str(path)).to(dtype or target.dtype).eval()
        depth = target.config.get_text_config().num_hidden_layers
        try:
            drafter.check_target(target)
            if drafter.config.num_target_layers in (None, depth):
                return drafter, True
            reason = (f"the shipped {family} drafter was made for a {drafter.config.num_target_layers}-layer target, "
                      f"this one has {depth} layers")
        except ValueError as exc:
            reason = f"the shipped {family} drafter does not fit this target: {exc}"
    if why is not None:
        why.append(reason)
    return DRAFTERS[family][1].from_target(target).eval(), False
