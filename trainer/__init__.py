"""Drafter training with the HF `Trainer` (issue #3): not implemented yet."""
