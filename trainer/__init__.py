"""Drafter training with the HF `Trainer`: `DrafterTrainingArguments`, pure losses, regenerated data, target
features (online or cached), `DrafterTrainer`, the acceptance-eval callback and the model card.

`from angelspec_hf.trainer import DrafterTrainer, DrafterTrainingArguments` works; the submodules load on first use,
so that `import angelspec_hf` stays light."""

import importlib

_EXPORTS = {
    "DrafterTrainer": "trainer", "pack_blocks": "trainer",
    "DrafterTrainingArguments": "arguments",
    "DrafterCollator": "dataset", "load_regenerated": "dataset",
    "AcceptanceEvalCallback": "evaluation", "measure_acceptance": "evaluation", "paired_tau_ratio": "evaluation",
    "ModelArguments": "run", "train": "run",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
