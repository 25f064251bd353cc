"""Online vs cached target features for drafter training, measured side by side on the embedded target.

    python benchmarks/feature_modes.py --steps 6 --threads 2
    python benchmarks/feature_modes.py --steps 8 --threads 2 --sets gsm8k code_alpaca gpteacher_codegen \
        --max-length 384 --num-anchors 64 --loss-kind ce+kl --init drafters/smollm2-135m-instruct-dfly
                                                        # the shipped DFly's recipe (scripts/train_release.sh)

Online: every step runs the frozen target over the batch. Cached: one pass stores fp16 features (Arrow, memory-mapped),
then steps read them. With `--bf16`, cached steps are timed again under the Trainer's bf16 autocast (`--bf16 true`:
the drafter's forward and backward in bf16, the target's states and the teacher's logits in fp32). Reports the median
step time of each, the one-off caching time, the epochs after which caching pays off, and bytes per token (fp16 cache
vs fp32)."""

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


def run(target, tokenizer, dataset, out, a, bf16=False):
    args = DrafterTrainingArguments(output_dir=out, drafter_type="dfly", max_steps=a.steps, report_to=[], use_cpu=True,
                                    per_device_train_batch_size=a.batch, save_strategy="no", logging_steps=a.steps,
                                    num_anchors=a.num_anchors, loss_kind=a.loss_kind, bf16=bf16)
    torch.manual_seed(0)
    drafter = (angelspec_hf.load_drafter(a.init).float() if a.init
               else angelspec_hf.DFlyDrafter.from_target(target))
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
    parser.add_argument("--sets", nargs="+", default=["gsm8k"])
    parser.add_argument("--max-length", type=int, default=512)
    parser.add_argument("--num-anchors", type=int, default=16)
    parser.add_argument("--loss-kind", default="ce")
    parser.add_argument("--bf16", action="store_true", help="also time cached steps with bf16 autocast (--bf16 true)")
    parser.add_argument("--init", default=None, help="a DFly folder to start from (its pruned vocabulary included)")
    a = parser.parse_args()
    torch.set_num_threads(a.threads)
    target, tokenizer = angelspec_hf.load_default_target()
    dataset = load_regenerated(tokenizer, a.data, a.sets, max_length=a.max_length, max_samples=a.samples)
    tokens = sum(len(x) for x in dataset["input_ids"])
    layer_ids = angelspec_hf.DFlyConfig.from_target(target).target_layer_ids
    with tempfile.TemporaryDirectory() as tmp:
        online = run(target, tokenizer, dataset, f"{tmp}/online", a)
        start = time.perf_counter()
        cached_ds = cache_features(target, dataset, layer_ids, f"{tmp}/features", final="kl" in a.loss_kind)
        cache_time = time.perf_counter() - start
        cached = run(target, tokenizer, cached_ds, f"{tmp}/cached", a)
        bf16 = run(target, tokenizer, cached_ds, f"{tmp}/bf16", a, bf16=True) if a.bf16 else None
    steps_per_epoch = len(dataset) / a.batch
    width = len(layer_ids) * target.config.hidden_size
    print(f"DFly (block 8{', from ' + a.init if a.init else ''}), batch {a.batch}, {a.num_anchors} anchors, "
          f"{a.loss_kind}, {len(dataset)} regenerated sequences of {'/'.join(a.sets)} ({tokens} tokens, cut at "
          f"{a.max_length}), {a.threads} threads, CPU")
    print(f"online : {online:.2f} s/step (median of {a.steps - 1})")
    print(f"cached : {cached:.2f} s/step (median of {a.steps - 1}), after a one-off {cache_time:.1f} s caching pass")
    if bf16 is not None:
        print(f"cached, bf16 autocast (the target's states stay fp32): {bf16:.2f} s/step (median of {a.steps - 1})")
    saved = (online - cached) * steps_per_epoch
    print(f"caching pays off after {cache_time / saved:.2f} epochs" if saved > 0 else "caching never pays off here")
    extra = target.config.hidden_size * 2 if "kl" in a.loss_kind else 0  # the final hidden state, for distillation
    print(f"bytes/token: cached fp16 {width * 2 + extra}, fp32 {(width + extra // 2) * 4} (ratio 0.5)")


if __name__ == "__main__":
    main()
