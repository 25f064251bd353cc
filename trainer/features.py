"""Target features for training: computed online from the frozen target (default, no disk), stored per sequence as
training first reads it (`StatesStore`: later epochs read them from disk), or cached once before training as fp16 in
a `datasets` Arrow table (memory-mapped; half the bytes of fp32 per token)."""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file


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


def _weights_checksum(model) -> str:
    """SHA-256 over the model's parameters, name by name, as raw bytes (dtype and shape included): exact, the same on
    every device, so two loads of the same weights agree and another fine-tune or another dtype does not."""
    digest = hashlib.sha256()
    with torch.no_grad():
        for name, param in model.named_parameters():
            data = param.detach().contiguous().cpu()
            digest.update(f"{name}:{str(data.dtype)}:{tuple(data.shape)};".encode())
            digest.update(data.reshape(-1).view(torch.uint8).numpy())  # the bytes, not a copy of them
    return digest.hexdigest()[:32]


class StatesStore:
    """Target states per training sequence on disk, filled as training reads them (`--feature_mode filling`).

    The first time a sequence is read, its states are computed online (by `target_states`, on the states target's
    device and in its dtype) and written to `folder` as one safetensors file named by a hash of its token ids; every
    later read of that sequence (the next epochs) loads the file instead of running the target. Nothing is computed
    before training starts, the states are stored exactly as computed (bf16 stays bf16), and the store is keyed by the
    target (architecture, dtype, a SHA-256 of all its weights, not the folder it was loaded from), the layers and
    whether final states are kept: another key is another subfolder, so a store is never read for a target or layers
    it was not written by. Files appear whole (written
    under a temporary name, then renamed), so a killed run leaves no partial file; a write that fails (a full disk) is
    reported once and training continues online. Batches must be right-padded (`DrafterCollator`)."""

    def __init__(self, folder, target, layer_ids, final: bool = False):
        weights = target.get_input_embeddings().weight.detach()
        config = target.config
        # The target by what it is (architecture, size, dtype, a checksum of its weights), not where it was loaded
        # from: the same target read from another folder (another cache, another machine) finds its store again.
        key = {"target": getattr(config, "model_type", "") or type(target).__name__,
               "layers": int(getattr(config, "num_hidden_layers", 0) or 0),
               "hidden_size": int(getattr(config, "hidden_size", 0) or 0),
               "dtype": str(weights.dtype).removeprefix("torch."), "layer_ids": [int(i) for i in layer_ids],
               "final": bool(final), "vocab": int(weights.shape[0]),
               "weights_checksum": _weights_checksum(target)}
        digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
        self.folder = Path(folder) / f"states-{digest}"
        self.folder.mkdir(parents=True, exist_ok=True)
        stamp = self.folder / "key.json"
        if not stamp.is_file():
            stamp.write_text(json.dumps(key, indent=1))
        self.layer_ids, self.final = list(layer_ids), bool(final)
        self.read = self.written = 0
        self._write_failed = False

    def path(self, ids: list[int]):
        """The file of the sequence `ids` (its unpadded token ids)."""
        return self.folder / f"{hashlib.sha1(np.asarray(ids, dtype=np.int64).tobytes()).hexdigest()}.safetensors"

    @torch.no_grad()
    def states(self, target, input_ids, attention_mask):
        """`target_states(target, input_ids, attention_mask, layer_ids, final)`, each row read from the store when it
        holds it and computed (and stored) when not. Padding positions are zeros."""
        lengths = attention_mask.sum(1).tolist()
        paths = [self.path(input_ids[i, :n].tolist()) for i, n in enumerate(lengths)]
        rows = {}
        for i, path in enumerate(paths):
            if path.is_file():
                try:
                    rows[i] = load_file(path)
                except Exception:  # unreadable (not written by a whole save): computed again, then replaced
                    continue
        self.read += len(rows)
        missing = [i for i in range(len(paths)) if i not in rows]
        if missing:
            width = max(lengths[i] for i in missing)
            index = torch.tensor(missing, device=input_ids.device)
            features, final = target_states(target, input_ids[index, :width], attention_mask[index, :width],
                                            self.layer_ids, self.final)
            for j, i in enumerate(missing):
                rows[i] = {"features": features[j, :lengths[i]]} | (
                    {"final": final[j, :lengths[i]]} if self.final else {})
                self._write(paths[i], rows[i])
        device, width = input_ids.device, input_ids.shape[1]

        def padded(name):
            first = rows[0][name]
            out = torch.zeros(len(paths), width, first.shape[-1], dtype=first.dtype, device=device)
            for i, n in enumerate(lengths):
                out[i, :n] = rows[i][name].to(device)
            return out

        return padded("features"), (padded("final") if self.final else None)

    def _write(self, path, tensors):
        if self._write_failed:
            return
        temporary = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        try:
            save_file({name: t.detach().to("cpu").contiguous() for name, t in tensors.items()}, str(temporary))
            os.replace(temporary, path)
            self.written += 1
        except (OSError, SafetensorError) as error:
            try:
                temporary.unlink(missing_ok=True)
            except OSError:
                pass
            self._write_failed = True
            print(f"target states store: cannot write to {self.folder} ({error}); training continues with states "
                  "computed online", file=sys.stderr, flush=True)


def target_features(target, input_ids, attention_mask, layer_ids) -> torch.Tensor:
    return target_states(target, input_ids, attention_mask, layer_ids)[0]


def cache_features(target, dataset, layer_ids, folder, batch_size: int = 8, final: bool = False,
                   shard_size: int = 512):
    """Add an fp16 `features` column (one `[T, H * len(layer_ids)]` array per example; with `final`, a `final` column
    of the target's last normed hidden states too, for distillation) and save to `folder`; returns the dataset
    re-opened from disk (memory-mapped). The target runs on its own device (the training device, see
    `angelspec_hf.trainer.run.train`); the arrays are copied to the host as fp16.

    The pass is written in shards of `shard_size` examples, each saved under a temporary name and renamed when whole,
    so a killed run loses at most the shard in progress: run again with the same data and layers, it keeps the shards
    done and computes the rest (the 8,496 code + math sequences of `data/regenerated/`, cut at 384 tokens, took
    17 shards of about 4.3 min each on 2 CPU threads, 12 GB with distillation's final states). A folder already holding the same columns for the same examples and layers (e.g. written by the
    DFlash run for the DFly run on identical data) is reused, not recomputed; one left by other data is replaced."""
    import shutil
    import time

    from datasets import concatenate_datasets, load_from_disk

    from .dataset import DrafterCollator

    folder = Path(folder)
    digest = hashlib.sha256(json.dumps([list(ids) for ids in dataset["input_ids"]]).encode()).hexdigest()
    key = {"layer_ids": list(layer_ids), "input_ids_sha256": digest, "num_rows": len(dataset)}
    if final:
        key["final"] = True
    stamp, partial = folder / "angelspec_features.json", folder / "angelspec_features.partial.json"
    done = json.loads(stamp.read_text()) if stamp.is_file() else None
    if done is not None and {k: v for k, v in done.items() if k != "shards"} == key:
        if "shards" not in done:  # written whole, before shards
            return load_from_disk(str(folder))
        return concatenate_datasets([load_from_disk(str(folder / name)) for name in done["shards"]])

    progress = key | {"shard_size": shard_size}
    if not (partial.is_file() and json.loads(partial.read_text()) == progress):  # nothing of this pass here yet
        if folder.is_dir():
            for old in [stamp, *folder.glob("shard-*"), *folder.glob("*.arrow"), folder / "dataset_info.json",
                        folder / "state.json"]:
                shutil.rmtree(old) if old.is_dir() else old.unlink(missing_ok=True)
        folder.mkdir(parents=True, exist_ok=True)
        partial.write_text(json.dumps(progress))
    for leftover in folder.glob("shard-*.tmp"):  # a shard a killed run was writing
        shutil.rmtree(leftover)

    collate = DrafterCollator(pad_token_id=0)
    device = next(target.parameters()).device  # the target runs where it is (the training device); arrays on the host

    def add_features(batch):
        examples = [dict(zip(batch, values)) for values in zip(*batch.values())]
        padded = collate(examples)
        feats, last = target_states(target, padded["input_ids"].to(device), padded["attention_mask"].to(device),
                                    layer_ids, final)
        columns = {"features": feats.half().cpu()} | ({"final": last.half().cpu()} if final else {})
        return {name: [v[: len(e["input_ids"])].numpy() for v, e in zip(values, examples)]
                for name, values in columns.items()}

    starts = range(0, len(dataset), shard_size)
    names = [f"shard-{i // shard_size:05d}" for i in starts]
    for i, name in zip(starts, names):
        if (folder / name).is_dir():
            continue
        began = time.perf_counter()
        shard = dataset.select(range(i, min(i + shard_size, len(dataset))))
        # batches of similar lengths (41% of a random batch's tokens were padding on the 8.5k code + math sequences,
        # 1% sorted), written back in the dataset's order
        order = sorted(range(len(shard)), key=lambda j: len(shard[j]["input_ids"]))
        computed = shard.select(order).map(add_features, batched=True, batch_size=batch_size,
                                           desc=f"target features, {name}")
        computed.select(sorted(range(len(order)), key=order.__getitem__)).save_to_disk(str(folder / f"{name}.tmp"))
        (folder / f"{name}.tmp").rename(folder / name)
        print(f"target features: {name} of {len(names)} (rows {i}–{i + len(shard) - 1}) written in "
              f"{time.perf_counter() - began:.0f} s", file=sys.stderr, flush=True)
    stamp.write_text(json.dumps(key | {"shards": names}))
    partial.unlink()
    return concatenate_datasets([load_from_disk(str(folder / name)) for name in names])
