"""Drafter training with the HF `Trainer`: `DrafterTrainingArguments`, pure losses, regenerated data, target
features (online or cached), `DrafterTrainer`, the acceptance-eval callback and the model card. Imported lazily
(`from angelspec_hf.trainer.trainer import DrafterTrainer`) so that `import angelspec_hf` stays light."""
