"""Drafter training throughput on CPU: training blocks per second of two recipes, measured interleaved on the same
TRAIN data (the regenerated code + math responses), then, optionally, a short run of each from the same drafter to
compare how the loss falls per block and the held-out τ reached.

    python benchmarks/train_throughput.py --threads 2 --rounds 3 --steps 4 \\
        --init drafters/smollm2-135m-instruct-dfly                       # speed only
    python benchmarks/train_throughput.py --threads 2 --rounds 3 --steps 4 --loss-blocks 25600 \\
        --init drafters/smollm2-135m-instruct-dfly                       # + a short run of each

The recipes (both DFly, block 8, ce+kl over the 8,192-token draft vocabulary, cut at 384 tokens, 4 sequences a step):

* `baseline`: random batches, 64 anchors per sequence, target states and teacher logits in fp32, drafter in fp32
  (scripts/train_release.sh before its CPU defaults);
* `fast`: batches grouped by length (`--train_sampling_strategy group_by_length`), 128 anchors per sequence
  (`--num_anchors 128`; padding anchors past every row's count are dropped), the target's training forward on a
  bf16 copy with compiled decoder layers (`--target_states_dtype bfloat16 --compile_target_states true`), the
  drafter under bf16 autocast (`--bf16 true`);
* `compiled`: `fast`, and the drafter's training forward and the loss compiled (`--compile_drafter true`);
* `sparse`: `compiled`, with attention computing only the scores the block mask keeps
  (`--block_sparse_attention true`; every other recipe runs dense SDPA under the mask);
* `stored`: `compiled`, with the target's states stored per sequence as training first reads it and read back
  after (`--feature_mode filling`): with `--repeat-batches` every round reads the warm-up round's batches again, as
  a second epoch does, so `stored` reads its states from the store while the others compute them.

Each recipe has one trainer; each round runs `--steps` steps of each in turn (`train()` again; its first step, which
pays one-off set-up, is not timed) on other batches than earlier rounds. Round 0 (warm-up: the target's one-off
compile) is reported, not counted. A block is an anchor with at least one supervised row. The short runs
train each recipe until it has seen `--loss-blocks` blocks, report a held-out loss against blocks seen (`HeldOutLoss`)
and the held-out τ reached (greedy, whole blocks, 64 new tokens, held-out TRAIN prompts:
`trainer.evaluation.held_out_prompts`)."""

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
from angelspec_hf.trainer.evaluation import HELD_OUT_SETS, held_out_prompts, measure_acceptance
from angelspec_hf.trainer.features import target_states
from angelspec_hf.trainer.trainer import DrafterTrainer

FAST = dict(num_anchors=128, train_sampling_strategy="group_by_length", target_states_dtype="bfloat16",
            compile_target_states=True, bf16=True)
RECIPES = {
    "baseline": dict(num_anchors=64),
    "fast": FAST,
    "compiled": FAST | dict(compile_drafter=True),
    "sparse": FAST | dict(compile_drafter=True, block_sparse_attention=True),
    "stored": FAST | dict(compile_drafter=True, feature_mode="filling"),
}
SETS = ["gsm8k", "code_alpaca", "gpteacher_codegen"]


class StepBlocks(TrainerCallback):
    """Per step: wall seconds and training blocks (from the trainer's `BlocksSeen` count)."""

    def __init__(self, trainer):
        self.trainer, self.steps, self._start = trainer, [], None

    def on_step_begin(self, args, state, control, **kwargs):
        self._start = (time.perf_counter(), self.trainer.blocks_seen.count)

    def on_step_end(self, args, state, control, **kwargs):
        began, blocks = self._start
        self.steps.append((time.perf_counter() - began, self.trainer.blocks_seen.count - blocks))


class HeldOutLoss(TrainerCallback):
    """Every `every` steps: the loss on one fixed batch of sequences that training does not reach in these short runs
    (the dataset's last ones), with fixed anchors (64 per sequence), fp32 target states and an fp32 drafter, so
    both recipes are measured alike (their training losses are not: more anchors per sequence sum more rows per
    supervised token)."""

    def __init__(self, trainer, batch, every):
        self.trainer, self.every, self.rows = trainer, every, []
        target = trainer.target
        features, final = target_states(target, batch["input_ids"], batch["attention_mask"],
                                        trainer._drafter.config.target_layer_ids, final=True)
        self.batch = batch | {"features": features, "final": final}

    def measure(self, state):
        trainer, model = self.trainer, self.trainer.model
        anchors, was_training = trainer.args.num_anchors, model.training
        trainer.args.num_anchors = 64
        model.eval()
        with torch.no_grad(), torch.autocast("cpu", enabled=False):
            loss = trainer.compute_loss(model, self.batch).item()
        trainer.args.num_anchors = anchors
        model.train(was_training)
        self.rows.append((trainer.blocks_seen.count, loss))

    def on_train_begin(self, args, state, control, **kwargs):
        self.measure(state)

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step % self.every == 0 or state.global_step == args.max_steps:
            self.measure(state)


def trainer_for(recipe, target, tokenizer, dataset, out, a, max_steps, logging_steps, lr_steps=None):
    args = DrafterTrainingArguments(
        output_dir=out, drafter_type="dfly", max_steps=max_steps, report_to=[], use_cpu=True,
        per_device_train_batch_size=a.batch, save_strategy="no", logging_steps=logging_steps, loss_kind="ce+kl",
        learning_rate=5e-4, warmup_steps=min(20, max_steps // 5), lr_scheduler_type="cosine", seed=a.seed,
        dataloader_num_workers=0, **RECIPES[recipe],
        **({"feature_cache_dir": f"{out}/states"} if RECIPES[recipe].get("feature_mode") == "filling" else {}))
    torch.manual_seed(0)
    drafter = angelspec_hf.load_drafter(a.init).float()
    return DrafterTrainer(drafter, args, target, train_dataset=dataset,
                          data_collator=DrafterCollator(tokenizer.pad_token_id))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=4, help="steps of each recipe per round (the first not timed)")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--recipes", nargs="+", default=list(RECIPES), choices=list(RECIPES))
    parser.add_argument("--data", default="data/regenerated/smollm2-135m-instruct")
    parser.add_argument("--init", default="drafters/smollm2-135m-instruct-dfly")
    parser.add_argument("--repeat-batches", action="store_true",
                        help="every round reads the warm-up round's batches (a second epoch: what 'stored' then reads "
                             "from its store)")
    parser.add_argument("--loss-blocks", type=int, default=0, help="> 0: then train each recipe for this many blocks")
    parser.add_argument("--eval-prompts", type=int, default=12)
    a = parser.parse_args()
    torch.set_num_threads(a.threads)
    target, tokenizer = angelspec_hf.load_default_target()
    dataset = load_regenerated(tokenizer, a.data, SETS, max_length=384, seed=a.seed)
    print(f"DFly from {a.init}, ce+kl, {len(dataset)} regenerated sequences of {'/'.join(SETS)} cut at 384 tokens, "
          f"batch {a.batch}, {a.threads} threads, CPU; {a.rounds} interleaved rounds of {a.steps} steps per recipe",
          flush=True)
    times = {name: [] for name in a.recipes}
    with tempfile.TemporaryDirectory() as tmp:
        trainers = {name: trainer_for(name, target, tokenizer, dataset, f"{tmp}/{name}", a, a.steps, a.steps)
                    for name in a.recipes}
        for r in range(a.rounds + 1):
            for name, trainer in trainers.items():
                timer = StepBlocks(trainer)
                trainer.add_callback(timer)
                # other batches and anchors each round, or with --repeat-batches the warm-up's batches again
                trainer.args.seed = trainer.args.data_seed = a.seed + (0 if a.repeat_batches else r)
                began = time.perf_counter()
                trainer.train()
                trainer.remove_callback(timer)
                if r == 0:
                    print(f"warm-up {name:>8}: {a.steps} steps in {time.perf_counter() - began:.0f} s", flush=True)
                    continue
                times[name] += timer.steps[1:]
                seconds, blocks = sum(t for t, _ in timer.steps[1:]), sum(b for _, b in timer.steps[1:])
                print(f"round {r} {name:>8}: {blocks / seconds:6.1f} blocks/s ({blocks} blocks in {seconds:.1f} s)",
                      flush=True)
        print("\nrecipe     blocks/s  s/step (median)  blocks/step")
        rate = {}
        for name, steps in times.items():
            rate[name] = sum(b for _, b in steps) / sum(t for t, _ in steps)
            print(f"{name:<9} {rate[name]:9.1f}  {statistics.median(t for t, _ in steps):15.2f}  "
                  f"{statistics.mean(b for _, b in steps):11.1f}")
        first = a.recipes[0]
        for name in a.recipes[1:]:
            print(f"{name} / {first}: {rate[name] / rate[first]:.2f}x blocks per second")
        if a.loss_blocks:
            prompts = held_out_prompts(HELD_OUT_SETS["dfly"], a.eval_prompts, a.data)
            fixed = DrafterCollator(tokenizer.pad_token_id)([dataset[i] for i in range(len(dataset) - 8, len(dataset))])
            for name in a.recipes:
                per_step = statistics.mean(b for _, b in times[name])
                steps = max(int(a.loss_blocks / per_step), 10)
                trainer = trainer_for(name, target, tokenizer, dataset, f"{tmp}/{name}-loss", a, steps,
                                      max(steps // 10, 1))
                losses = HeldOutLoss(trainer, fixed, max(steps // 5, 1))
                trainer.add_callback(losses)
                began = time.perf_counter()
                trainer.train()
                wall = time.perf_counter() - began
                tau = measure_acceptance(trainer.target, trainer._drafter, tokenizer, prompts)
                print(f"\n{name}: {steps} steps, {trainer.blocks_seen.count} blocks in {wall:.0f} s; held-out τ "
                      f"{tau['tau']:.3f} (first {tau['first']:.3f}, {len(prompts)} prompts)")
                print("  held-out loss by blocks seen: " + "  ".join(f"{b}:{loss:.3f}" for b, loss in losses.rows),
                      flush=True)


if __name__ == "__main__":
    main()
