"""`angelspec train`: the training entry point (flags or a YAML/JSON file, parsed by `HfArgumentParser`).

    angelspec train --drafter_type dfly --output_dir runs/dfly --max_steps 2000 --per_device_train_batch_size 8
    angelspec train recipe.yaml
    torchrun --nproc_per_node 2 -m angelspec_hf.trainer.run ...        # several processes (DDP via accelerate)
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from transformers import HfArgumentParser, set_seed

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
    else:
        overrides = parse_config_overrides(margs.config_overrides, DRAFTERS[args.drafter_type][0])
        if args.target_layer_ids is not None:
            overrides["target_layer_ids"] = args.target_layer_ids
        if args.num_drafter_layers is not None:
            overrides["num_hidden_layers"] = args.num_drafter_layers
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
    target, tokenizer = angelspec_hf.load_target(margs.target)
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
    callback = None
    if args.eval_prompts:
        callback = AcceptanceEvalCallback(trainer, tokenizer, args.eval_prompts, args.eval_max_new_tokens)
        trainer.add_callback(callback)
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
    trainer.save_model(args.output_dir)  # every process calls it (sharded setups need that); rank 0 writes
    trainer.save_state()
    if trainer.is_world_process_zero():
        trainer.create_model_card()
    return trainer


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = HfArgumentParser((ModelArguments, DrafterTrainingArguments))
    if len(argv) == 1 and argv[0].endswith((".yaml", ".yml", ".json")):
        parse = parser.parse_yaml_file if argv[0].endswith(("yaml", "yml")) else parser.parse_json_file
        margs, args = parse(str(Path(argv[0]).resolve()))
    else:
        margs, args = parser.parse_args_into_dataclasses(argv)
    train(margs, args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
