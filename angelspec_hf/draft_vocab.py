"""Choosing a pruned draft vocabulary (EAGLE-3's `d2t`, FR-Spec): the target tokens a drafter may propose.

The most frequent tokens of the target's own responses to TRAIN prompts (`data/regenerated/`, the drafter's
training data) cover almost everything it writes; drafting only over them makes each draft token's LM head a fraction
of the full one. Responses are few next to the vocabulary, so the rest of the budget goes to the most frequent tokens
of the TRAIN prompts themselves (replies copy names, numbers and code from their prompts). Coverage — the share of the target's tokens inside the subset — bounds first-token acceptance
(`acceptance <= coverage` per position), so it is reported on responses the subset was not chosen from: the target's
greedy replies to EVAL prompts.

    angelspec prune-vocab --drafter dfly --size 8192 --out my-dfly-8k
"""

from __future__ import annotations

from collections import Counter

from angelspec_hf.devices import add_device_arguments


def response_token_counts(files) -> Counter:
    """Token frequencies over the `response_ids` of regenerated jsonl files (`.jsonl.gz` or plain `.jsonl`)."""
    from angelspec_hf.trainer.regenerated_files import read_records

    counts = Counter()
    for path in files:
        for rec in read_records(path):
            counts.update(rec["response_ids"])
    return counts


def choose_draft_vocab(counts: Counter, size: int, always=(), fill: Counter | None = None) -> list[int]:
    """Every id in `always` (special tokens: EOS must be draftable), then the most frequent ids of `counts`, then of
    `fill`, until there are `size` (ties by id)."""
    if size < 1:
        raise ValueError(f"size must be >= 1, got {size}")
    chosen = set(always)
    for source in (counts, fill or Counter()):
        for token, _ in sorted(source.items(), key=lambda item: (-item[1], item[0])):
            if len(chosen) >= size:
                return sorted(chosen)
            chosen.add(token)
    return sorted(chosen)


def prompt_token_counts(tokenizer, sets) -> Counter:
    """Token frequencies over the TRAIN prompts of `sets` (never EVAL files)."""
    from angelspec_hf.trainer.data import load_train_prompts

    counts = Counter()
    for name in sets:
        for record in load_train_prompts(name):
            counts.update(tokenizer(record["prompt"], add_special_tokens=False)["input_ids"])
    return counts


def coverage(ids, token_lists) -> float:
    """Share of the tokens in `token_lists` that are in `ids`."""
    keep = set(ids)
    total = sum(len(tokens) for tokens in token_lists)
    return sum(t in keep for tokens in token_lists for t in tokens) / total if total else float("nan")


def cmd_prune_vocab(args) -> int:
    import torch

    import angelspec_hf
    from angelspec_hf.modeling import DRAFTERS
    from angelspec_hf.prompts import chat_input_ids, load_eval_prompts

    torch.set_num_threads(args.threads)
    target, tokenizer = angelspec_hf.load_target(args.target, device=args.device, dtype=args.dtype)
    if args.drafter in DRAFTERS:
        from angelspec_hf.shipped import shipped_drafter_path

        path = shipped_drafter_path(args.drafter)
        if path is None:
            raise SystemExit(f"no trained {args.drafter} drafter ships: pass a folder or Hub id")
        drafter = angelspec_hf.load_drafter(str(path))  # in its stored dtype, which the output keeps
    else:
        drafter = angelspec_hf.load_drafter(args.drafter)
    drafter.check_target(target)
    from angelspec_hf.trainer.regenerated_files import regenerated_file

    names = args.sets.split(",")
    try:
        files = [regenerated_file(args.data, name) for name in names]
    except FileNotFoundError as error:
        raise SystemExit(str(error)) from None
    counts = response_token_counts(files)
    eos = target.generation_config.eos_token_id
    specials = set(eos if isinstance(eos, list) else [eos]) | set(tokenizer.all_special_ids)
    fill = prompt_token_counts(tokenizer, [s for s in args.prompt_sets.split(",") if s])
    ids = choose_draft_vocab(counts, args.size, always=specials - {None}, fill=fill)
    from_responses = len(set(counts) | (specials - {None}))
    print(f"draft vocabulary: {len(ids)} of {target.config.get_text_config().vocab_size} ids: "
          f"{min(from_responses, len(ids))} from {sum(counts.values())} response tokens of "
          f"{', '.join(names)}, the rest from {sum(fill.values())} TRAIN prompt tokens")
    for name in [s for s in args.eval_sets.split(",") if s] if args.eval_prompts else []:
        replies = []
        for prompt in load_eval_prompts(name, args.eval_prompts):
            input_ids = chat_input_ids(tokenizer, prompt, device=target.device)
            out = target.generate(input_ids, max_new_tokens=args.eval_tokens, do_sample=False)
            replies.append(out[0, input_ids.shape[1]:].tolist())
        print(f"coverage on the target's greedy replies to {len(replies)} EVAL {name} prompts "
              f"({sum(map(len, replies))} tokens): {coverage(ids, replies):.4f}")
    drafter.set_draft_vocab(ids)
    drafter.save_pretrained(args.out)
    print(f"wrote {args.out}")
    return 0


def add_prune_vocab_parser(sub) -> None:
    p = sub.add_parser("prune-vocab", help="draft over the most frequent target tokens only")
    p.add_argument("--drafter", default="dfly", help="mtp|dflash|dfly (shipped) or a folder / Hub id")
    p.add_argument("--target", default=None)
    p.add_argument("--size", type=int, default=8192, help="number of target token ids kept")
    p.add_argument("--data", default="data/regenerated/smollm2-135m-instruct", help="folder of regenerated TRAIN responses "
                   "(<set>.jsonl.gz or <set>.jsonl)")
    p.add_argument("--sets", default="gsm8k,code_alpaca,gpteacher_codegen,sharegpt,alpaca",
                   help="regenerated TRAIN response files to count")
    p.add_argument("--prompt-sets", default="gsm8k,code_alpaca,gpteacher_codegen,sharegpt,alpaca",
                   help="TRAIN prompt sets whose tokens fill the rest of the budget")
    p.add_argument("--eval-sets", default="humaneval,gsm8k,mt_bench", help="coverage measured on these EVAL sets")
    p.add_argument("--eval-prompts", type=int, default=4, help="EVAL prompts per set (0: skip the coverage check)")
    p.add_argument("--eval-tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=2)
    add_device_arguments(p)
    p.add_argument("--out", required=True)
    p.set_defaults(func=cmd_prune_vocab)
