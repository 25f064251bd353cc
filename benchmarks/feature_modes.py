"""Online vs cached target features for drafter training, measured side by side on the embedded target.

    python benchmarks/feature_modes.py --steps 6 --threads 2

Online: every step runs the frozen target over the batch. Cached: one pass stores fp16 features (Arrow, memory-mapped),
then steps read them. Reports the median step time of each, the one-off caching time, the epochs after which caching
pays off, and bytes per token (fp16 cache vs fp32)."""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch
from transformers import TrainerCallback

import angelspec_hf
from angelspec_hf.trainer.arguments import DrafterTrainingArguments
from angelspec_hf.trainer.dataset import DrafterCollator, load_regenerated
from angelspec_hf.trainer.features import cache_features
from angelspec_hf.trainer.trainer import DrafterTrainer


class StepTimes(TrainerCallback):
    def __init__(self):
        self.times, self._start = [], None

    def on_step_begin(self, args, state, control, **kwargs):
        self._start = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        self.times.append(time.perf_counter() - self._start)


def run(target, tokenizer, dataset, out, steps, batch):
    args = DrafterTrainingArguments(output_dir=out, drafter_type="dfly", max_steps=steps, report_to=[], use_cpu=True,
                                    per_device_train_batch_size=batch, save_strategy="no", logging_steps=steps)
    torch.manual_seed(0)
    drafter = angelspec_hf.DFlyDrafter.from_target(target)
    timer = StepTimes()
    DrafterTrainer(drafter, args, target, train_dataset=dataset, data_collator=DrafterCollator(tokenizer.pad_token_id),
                   callbacks=[timer]).train()
    return statistics.median(timer.times[1:])  # the first step pays one-off set-up


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--samples", type=int, default=48)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--data", default="data/regenerated/smollm2-135m-instruct")
    a = parser.parse_args()
    torch.set_num_threads(a.threads)
    target, tokenizer = angelspec_hf.load_default_target()
    dataset = load_regenerated(tokenizer, a.data, ["gsm8k"], max_length=512, max_samples=a.samples)
    tokens = sum(len(x) for x in dataset["input_ids"])
    layer_ids = angelspec_hf.DFlyConfig.from_target(target).target_layer_ids
    with tempfile.TemporaryDirectory() as tmp:
        online = run(target, tokenizer, dataset, f"{tmp}/online", a.steps, a.batch)
        start = time.perf_counter()
        cached_ds = cache_features(target, dataset, layer_ids, f"{tmp}/features")
        cache_time = time.perf_counter() - start
        cached = run(target, tokenizer, cached_ds, f"{tmp}/cached", a.steps, a.batch)
    steps_per_epoch = len(dataset) / a.batch
    width = len(layer_ids) * target.config.hidden_size
    print(f"DFly (block 8), batch {a.batch}, {len(dataset)} GSM8K regenerated sequences ({tokens} tokens), "
          f"{a.threads} threads, CPU")
    print(f"online : {online:.2f} s/step (median of {a.steps - 1})")
    print(f"cached : {cached:.2f} s/step (median of {a.steps - 1}), after a one-off {cache_time:.1f} s caching pass")
    saved = (online - cached) * steps_per_epoch
    print(f"caching pays off after {cache_time / saved:.2f} epochs" if saved > 0 else "caching never pays off here")
    print(f"bytes/token: cached fp16 {width * 2}, fp32 {width * 4} (ratio 0.5)")


if __name__ == "__main__":
    main()
