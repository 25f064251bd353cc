"""Target features for training: computed online from the frozen target (default, no disk), or cached once as fp16
in a `datasets` Arrow table (memory-mapped; half the bytes of fp32 per token)."""

from __future__ import annotations

import torch


@torch.no_grad()
def target_states(target, input_ids, attention_mask, layer_ids, final: bool = False):
    """`(features, final_hidden)`: features `[N, T, H * len(layer_ids)]` are the outputs of the target's decoder layers
    `layer_ids` (0-based), concatenated; `final_hidden` `[N, T, H]` (only when `final`) is the target's last, normed
    hidden state, so that `lm_head(final_hidden[:, t])` is the target's logits for token t + 1 at any chosen rows
    without computing them at every position."""
    out = target.base_model(
        input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=[i + 1 for i in layer_ids],
        use_cache=False,
    )
    features = torch.cat([out.hidden_states[i + 1] for i in layer_ids], dim=-1)
    return features, (out.last_hidden_state if final else None)


def target_features(target, input_ids, attention_mask, layer_ids) -> torch.Tensor:
    return target_states(target, input_ids, attention_mask, layer_ids)[0]


def cache_features(target, dataset, layer_ids, folder, batch_size: int = 8, final: bool = False):
    """Add an fp16 `features` column (one `[T, H * len(layer_ids)]` array per example; with `final`, a `final` column
    of the target's last normed hidden states too, for distillation) and save to `folder`; returns the dataset
    re-opened from disk (memory-mapped). A folder already holding the same columns for the same examples and layers
    (e.g. written by the DFlash run for the DFly run on identical data) is reused, not recomputed."""
    import json
    from pathlib import Path

    from datasets import load_from_disk

    import hashlib

    digest = hashlib.sha256(json.dumps([list(ids) for ids in dataset["input_ids"]]).encode()).hexdigest()
    key = {"layer_ids": list(layer_ids), "input_ids_sha256": digest, "num_rows": len(dataset)}
    if final:
        key["final"] = True
    stamp = Path(folder) / "angelspec_features.json"
    if stamp.is_file() and json.loads(stamp.read_text()) == key:
        return load_from_disk(str(folder))

    from .dataset import DrafterCollator

    collate = DrafterCollator(pad_token_id=0)

    def add_features(batch):
        examples = [dict(zip(batch, values)) for values in zip(*batch.values())]
        padded = collate(examples)
        feats, last = target_states(target, padded["input_ids"], padded["attention_mask"], layer_ids, final)
        columns = {"features": feats.half()} | ({"final": last.half()} if final else {})
        return {name: [v[: len(e["input_ids"])].numpy() for v, e in zip(values, examples)]
                for name, values in columns.items()}

    dataset.map(add_features, batched=True, batch_size=batch_size).save_to_disk(str(folder))
    stamp.write_text(json.dumps(key))
    return load_from_disk(str(folder))
