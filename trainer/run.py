"""`angelspec train`: the training entry point (flags or a YAML/JSON file, parsed by `HfArgumentParser`).

    angelspec train --drafter_type dfly --output_dir runs/dfly --max_steps 2000 --per_device_train_batch_size 8
    angelspec train recipe.yaml
    torchrun --nproc_per_node 2 -m angelspec_hf.trainer.run ...        # several processes (DDP via accelerate)

`--device cpu` trains on the CPU (it sets `--use_cpu true`); `--device cuda` on the GPU(s), one per process; the
default, auto, is what the Trainer picks (a GPU when one is visible). The frozen target and its features (online or
cached) are computed on the training device, the target in `--dtype` (auto: float32 on cpu, bfloat16 on cuda).
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from transformers import HfArgumentParser, TrainerCallback, set_seed
from transformers.hf_argparser import string_to_bool

from angelspec_hf.devices import DeviceError, resolve_device, resolve_dtype
from angelspec_hf.policy.corpus import CorpusIndex
from angelspec_hf.policy.costs import clock

from .arguments import DrafterTrainingArguments

EMBEDDED_TARGET_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"


@dataclass
class ModelArguments:
    target: str | None = field(default=None, metadata={"help": "Target HF id or folder (default: embedded SmolLM2)."})
    init_drafter: str | None = field(
        default=None, metadata={"help": "Start from this drafter (folder or Hub id) instead of a fresh one."}
    )
    draft_vocab_from: str | None = field(
        default=None, metadata={"help": "Give the drafter the pruned draft vocabulary of this drafter (folder or Hub "
                                        "id); training then runs over those ids (see train_vocab)."}
    )
    config_overrides: str | None = field(
        default=None, metadata={"help": "A fresh drafter's config fields, as in transformers' run_clm: "
                                        "'use_ar_head=false,num_hidden_layers=2'."}
    )
    lora_r: int = field(default=0, metadata={"help": "> 0: train a LoRA adapter of this rank (PEFT) instead."})
    lora_alpha: int = field(default=16, metadata={"help": "LoRA alpha."})
    resume: bool = field(default=False, metadata={"help": "Continue from the last checkpoint in output_dir."})
    device: str = field(
        default="auto", metadata={"help": "Training device: auto (the Trainer's choice: a GPU when one is visible), "
                                          "cpu (sets use_cpu) or cuda (one GPU per process; choose them with "
                                          "CUDA_VISIBLE_DEVICES). The target and its features run there too."}
    )
    dtype: str = field(
        default="auto", metadata={"help": "The frozen target's dtype: auto (float32 on cpu, bfloat16 on cuda), "
                                          "float32, bfloat16 or float16. The drafter trains in float32 (see bf16)."}
    )


def last_complete_checkpoint(output_dir) -> str | None:
    """The newest `checkpoint-N` that was fully written. The Trainer writes `trainer_state.json` last, and a run killed
    while saving leaves a newer folder without it, which `transformers.trainer_utils.get_last_checkpoint` would pick."""
    done = [p.parent for p in Path(output_dir).glob("checkpoint-*/trainer_state.json")]
    return str(max(done, key=lambda p: int(p.name.split("-")[-1]))) if done else None


def parse_config_overrides(text: str | None, config_class) -> dict:
    """`"a=1,b=false,c=silu"` -> `{"a": 1, "b": False, "c": "silu"}`; a field the config does not have is refused."""
    import dataclasses
    import json

    known = {f.name for f in dataclasses.fields(config_class)}
    out = {}
    for item in filter(None, (part.strip() for part in (text or "").split(","))):
        key, sep, value = (s.strip() for s in item.partition("="))
        if not sep or not key:
            raise ValueError(f"config_overrides: expected key=value, got {item!r}")
        if key not in known:
            raise ValueError(f"config_overrides: {config_class.__name__} has no field {key!r}")
        try:
            out[key] = json.loads(value.lower() if value.lower() in ("true", "false", "null") else value)
        except json.JSONDecodeError:
            out[key] = value
    return out


class TimeLimit(TrainerCallback):
    """Ends training at the first step that finishes `seconds` after training began (`max_train_seconds`), with a
    checkpoint of that step (so `--resume true` continues from exactly there); the Trainer then stops as at
    `max_steps`, and `train` saves the drafter, its state and its card."""

    def __init__(self, seconds: float, clock=time.monotonic):
        self.seconds, self.clock, self.start = seconds, clock, None

    def on_train_begin(self, args, state, control, **kwargs):
        self.start = self.clock()

    def on_step_end(self, args, state, control, **kwargs):
        if self.clock() - self.start >= self.seconds:
            control.should_training_stop = control.should_save = True
            print(f"max_train_seconds: stopping after step {state.global_step} ({self.clock() - self.start:.0f} s)",
                  flush=True)
        return control


class StepLimit(TrainerCallback):
    """Ends training after step `step` (`stop_at_step`) with a checkpoint of it, as `TimeLimit` does for time: the
    learning-rate schedule stays the one `max_steps` shapes."""

    def __init__(self, step: int):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step >= self.step:
            control.should_training_stop = control.should_save = True
        return control


def build_drafter(margs: ModelArguments, args: DrafterTrainingArguments, target):
    import angelspec_hf
    from angelspec_hf.modeling import DRAFTERS

    if margs.init_drafter:
        if margs.config_overrides:
            raise ValueError("config_overrides shape a fresh drafter; it cannot be combined with init_drafter")
        drafter = angelspec_hf.load_drafter(margs.init_drafter)
        if args.num_drafter_layers is not None and args.num_drafter_layers != drafter.config.num_hidden_layers:
            if not hasattr(drafter, "grow_layers"):
                raise ValueError(f"num_drafter_layers: a {type(drafter).__name__} cannot be deepened after training")
            drafter.grow_layers(args.num_drafter_layers)  # warm start: the deeper drafter computes what it did
        if args.ar_head_intermediate_size is not None:
            if not hasattr(drafter, "grow_ar_head"):
                raise ValueError(f"ar_head_intermediate_size: a {type(drafter).__name__} has no AR head")
            drafter.grow_ar_head(args.ar_head_intermediate_size)  # the wider head computes what it did
    else:
        overrides = parse_config_overrides(margs.config_overrides, DRAFTERS[args.drafter_type][0])
        if args.target_layer_ids is not None:
            overrides["target_layer_ids"] = args.target_layer_ids
        if args.num_drafter_layers is not None:
            overrides["num_hidden_layers"] = args.num_drafter_layers
        if args.ar_head_intermediate_size is not None:
            if args.drafter_type != "dfly":
                raise ValueError(f"ar_head_intermediate_size: a {args.drafter_type} drafter has no AR head")
            overrides["ar_head_intermediate_size"] = args.ar_head_intermediate_size
        if args.drafter_type == "mtp":
            overrides["num_draft_tokens"] = args.mtp_num_steps
        else:
            overrides["block_size"] = args.block_size
        drafter = DRAFTERS[args.drafter_type][1].from_target(target, **overrides)
    if margs.draft_vocab_from:
        ids = getattr(angelspec_hf.load_drafter(margs.draft_vocab_from), "draft_vocab_ids", None)
        if ids is None:
            raise ValueError(f"{margs.draft_vocab_from} has no pruned draft vocabulary (draft_vocab_ids)")
        drafter.set_draft_vocab(ids)
    drafter.float()  # trained in fp32 even when started from a shipped fp16 drafter
    if margs.lora_r > 0:
        from peft import LoraConfig, get_peft_model

        modules = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
        drafter = get_peft_model(drafter, LoraConfig(r=margs.lora_r, lora_alpha=margs.lora_alpha, target_modules=modules))
    return drafter


def train(margs: ModelArguments, args: DrafterTrainingArguments):
    import angelspec_hf

    from .dataset import DrafterCollator, load_regenerated
    from .evaluation import AcceptanceEvalCallback
    from .features import cache_features
    from .trainer import DrafterTrainer

    start = time.time()
    # on the training device (this process's, under DDP), so cached features are computed there too
    target, tokenizer = angelspec_hf.load_target(margs.target, device=args.device,
                                                 dtype=resolve_dtype(margs.dtype, args.device))
    set_seed(args.seed)  # a fresh drafter's initial weights are part of the run's reproducibility
    drafter = build_drafter(margs, args, target)
    dataset = load_regenerated(tokenizer, args.regenerated_dir, args.train_sets, args.max_seq_length,
                               args.max_train_samples, args.seed if args.dataset_seed is None else args.dataset_seed)
    if args.feature_mode == "cached":  # the main process writes them (resumably); the others then read them
        with args.main_process_first(local=False, desc="target features"):
            dataset = cache_features(target, dataset, drafter.config.target_layer_ids, args.feature_cache_dir,
                                     final="kl" in args.loss_kind)
    trainer = DrafterTrainer(drafter, args, target, train_dataset=dataset,
                             data_collator=DrafterCollator(tokenizer.pad_token_id))
    trainer.base_model_id = margs.target or EMBEDDED_TARGET_ID
    if args.max_train_seconds:
        trainer.add_callback(TimeLimit(args.max_train_seconds, clock=functools.partial(clock, args.device)))
    if args.stop_at_step:
        trainer.add_callback(StepLimit(args.stop_at_step))
    callback = None
    if args.eval_prompts:
        callback = AcceptanceEvalCallback(trainer, tokenizer, args.eval_prompts, args.eval_max_new_tokens,
                                          held_out=args.eval_prompts_from == "held_out",
                                          regenerated_dir=args.regenerated_dir)
        trainer.add_callback(callback)
        if trainer.fitted_schedule is not None:  # the evals due before the fitted end take their share of the time
            trainer.fitted_schedule.eval_seconds = lambda: callback.seconds
    resume = args.resume_from_checkpoint
    if margs.resume and Path(args.output_dir).is_dir():
        resume = last_complete_checkpoint(args.output_dir)
    result = trainer.train(resume_from_checkpoint=resume)
    trainer.acceptance = {k.split("/", 1)[1]: v for k, v in (callback.last if callback else {}).items()
                          if k.startswith("tau/")}
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    trainer.training_summary = {
        "drafter": args.drafter_type, "steps": trainer.state.global_step,
        "epochs": f"{trainer.state.epoch:.2f}", "sequences": len(dataset),
        "loss": args.loss_kind, "anchors per sequence": args.num_anchors,
        "anchors": "redrawn every step" if args.resample_anchors else "fixed per example",
        "tokens per epoch": sum(len(ids) for ids in dataset["input_ids"]),
        "supervised tokens per epoch": sum(sum(s) for s in dataset["supervised"]),
        "mean training loss": f"{result.training_loss:.4f}",
        "last logged loss": f"{losses[-1]:.4f}" if losses else "n/a",
        "wall time (s)": f"{time.time() - start:.0f}", "processes": trainer.accelerator.num_processes,
    }
    if args.lookup_corpus and trainer.is_world_process_zero():
        # the drafter's corpus lookups: the replies it was trained on, written before `save_model`, which pushes
        Path(args.output_dir).mkdir(parents=True, exist_ok=True)
        CorpusIndex.from_regenerated(args.regenerated_dir, args.train_sets).save(
            args.output_dir, source=f"regenerated replies {Path(args.regenerated_dir).name}: "
                                    f"{', '.join(args.train_sets)}")
    trainer.save_model(args.output_dir)  # every process calls it (sharded setups need that); rank 0 writes
    trainer.save_state()
    if trainer.is_world_process_zero():
        trainer.create_model_card()
    return trainer


def use_cpu_for(device: str | None, use_cpu: bool | None) -> bool | None:
    """The `use_cpu` the Trainer gets for `--device`: True for cpu, False for a GPU, `use_cpu` as given for auto.
    Raises `DeviceError` for a device this machine lacks, a contradiction (`--device cuda --use_cpu true`) or a GPU
    index (the Trainer puts process k on cuda:k)."""
    if device is None or str(device).strip().lower() == "auto":
        return use_cpu
    resolved = resolve_device(device)
    if resolved.type == "cpu":
        if use_cpu is False:
            raise DeviceError(f"--device {device} contradicts --use_cpu false")
        return True
    if use_cpu:
        raise DeviceError(f"--device {device} contradicts --use_cpu true")
    if resolved.index not in (None, 0):
        raise DeviceError(f"--device {device}: the Trainer runs process k on cuda:k; choose the GPUs with "
                          "CUDA_VISIBLE_DEVICES and pass --device cuda")
    return False


def _as_bool(value) -> bool | None:
    return None if value is None else string_to_bool(value)


EXAMPLES = """\
examples:
  angelspec train --drafter_type dfly --output_dir runs/dfly --max_steps 2000 --per_device_train_batch_size 8
  angelspec train --target ./my-model --regenerated_dir ./my-model-data --train_sets gsm8k code_alpaca \\
      --drafter_type dfly --output_dir runs/my-dfly --max_steps 500
  angelspec train recipe.yaml       # the same fields in a YAML or JSON file"""


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Defaults beside each flag (HfArgumentParser's own choice), the examples as written."""


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = HfArgumentParser((ModelArguments, DrafterTrainingArguments), prog="angelspec train", epilog=EXAMPLES,
                              formatter_class=_HelpFormatter)
    if len(argv) == 1 and argv[0].endswith((".yaml", ".yml", ".json")):
        import json

        import yaml

        text = Path(argv[0]).read_text()
        values = yaml.safe_load(text) if argv[0].endswith(("yaml", "yml")) else json.loads(text)
        use_cpu = use_cpu_for(values.get("device"), _as_bool(values.get("use_cpu")))
        if use_cpu is not None:
            values["use_cpu"] = use_cpu
        margs, args = parser.parse_dict(values)
    else:
        # `--use_cpu` follows `--device`, and the TrainingArguments pick their device when built: decide it first
        pre = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
        pre.add_argument("--device", default=None)
        pre.add_argument("--use_cpu", "--use-cpu", nargs="?", const="true", default=None)
        known, _ = pre.parse_known_args(argv)
        use_cpu = use_cpu_for(known.device, _as_bool(known.use_cpu))
        if use_cpu is not None:
            argv = [*argv, "--use_cpu", str(use_cpu).lower()]
        margs, args = parser.parse_args_into_dataclasses(argv)
    train(margs, args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
