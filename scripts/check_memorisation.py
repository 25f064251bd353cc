"""The end-to-end alignment check on the real target: train a drafter on a handful of regenerated
sequences until it can memorise them, then draft for exactly those prompts. If features, labels, positions, anchors or
the chat template were off by one anywhere between regeneration, training and drafting, τ stays far below the block.

    python scripts/check_memorisation.py --family dfly --sequences 4 --steps 150 [--init drafters/...-dfly]

It prints the training loss and the greedy τ / first-token acceptance on those prompts (over as many new tokens as
their shortest regenerated response, so generation follows the memorised text). Prompts: TRAIN (gsm8k) only.
"""

from __future__ import annotations

import argparse
import itertools
import json
import tempfile
from pathlib import Path

import torch

REGENERATED = Path(__file__).resolve().parent.parent / "data" / "regenerated" / "smollm2-135m-instruct"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--family", default="dfly", choices=["mtp", "dflash", "dfly"])
    parser.add_argument("--set", default="gsm8k")
    parser.add_argument("--sequences", type=int, default=4)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--anchors", type=int, default=64)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--loss", default="ce")
    parser.add_argument("--init", default=None, help="start from this drafter (default: a fresh one)")
    parser.add_argument("--draft-vocab-from", default="drafters/smollm2-135m-instruct-dfly",
                        help="train over this drafter's pruned vocabulary ('' for the full one)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

    import angelspec_hf
    from angelspec_hf.prompts import chat_input_ids
    from angelspec_hf.trainer.arguments import DrafterTrainingArguments
    from angelspec_hf.trainer.evaluation import whole_blocks
    from angelspec_hf.trainer.run import ModelArguments, train

    from angelspec_hf.trainer.regenerated_files import read_records, regenerated_file

    records = list(itertools.islice(read_records(regenerated_file(REGENERATED, args.set)), args.sequences))
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "regenerated"
        folder.mkdir()
        with open(folder / f"{args.set}.jsonl", "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in records)
        targs = DrafterTrainingArguments(
            output_dir=str(Path(tmp) / "run"), drafter_type=args.family, train_sets=[args.set],
            regenerated_dir=str(folder), per_device_train_batch_size=args.sequences, max_steps=args.steps,
            learning_rate=args.lr, warmup_steps=10, num_anchors=args.anchors, loss_kind=args.loss,
            max_seq_length=768, logging_steps=max(args.steps // 10, 1), save_strategy="no", report_to=[],
            use_cpu=True, dataloader_num_workers=0, feature_mode="cached", feature_cache_dir=str(Path(tmp) / "feats"),
            seed=0,
        )
        trainer = train(ModelArguments(init_drafter=args.init, draft_vocab_from=args.draft_vocab_from or None), targs)
        losses = [(h["step"], round(h["loss"], 3)) for h in trainer.state.log_history if "loss" in h]
        print("loss by step:", losses)
        drafter, target = whole_blocks(trainer.accelerator.unwrap_model(trainer.model).eval()).__enter__(), trainer.target
        _, tokenizer = angelspec_hf.load_target(None)
        new_tokens = min(args.max_new_tokens, min(r["num_tokens"] for r in records))
        accepted, rounds, first = 0, 0, []
        for rec in records:
            ids = chat_input_ids(tokenizer, rec["prompt"])
            out = target.generate(ids, assistant_model=drafter, max_new_tokens=new_tokens, do_sample=False)
            assert out[0, ids.shape[1]:].tolist() == rec["response_ids"][: out.shape[1] - ids.shape[1]], \
                "the target's greedy output differs from the regenerated response"
            stats = drafter.last_speculation_stats
            accepted += sum(stats.accepted)
            rounds += stats.rounds
            first += [a >= 1 for a in stats.accepted]
        block = getattr(drafter.config, "block_size", None) or drafter.config.num_draft_tokens + 1
        print(f"{args.family}: tau {(accepted + rounds) / rounds:.2f} of at most {block}, first-token acceptance "
              f"{sum(first) / len(first):.2f} over {rounds} rounds, {len(records)} memorised prompts, "
              f"{new_tokens} new tokens each")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
