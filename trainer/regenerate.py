"""Self-distillation data: the target's own responses to TRAIN prompts, so a drafter learns what the target says.

Batched (left-padded) generation, appended batch by batch and fsync'd to a jsonl file, gzip (`<set>.jsonl.gz`: one
gzip member per batch) or plain (`<set>.jsonl`) by its name (`regenerated_files.output_file` picks it), so a killed
run resumes where it stopped: records whose `id` is already in the file are skipped.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from angelspec_hf.prompts import chat_ids
from angelspec_hf.trainer.regenerated_files import append_lines, done_ids


def regenerate(
    target,
    tokenizer,
    records: list[dict],
    out_path,
    *,
    batch_size: int = 16,
    max_new_tokens: int = 256,
    max_prompt_tokens: int = 512,
    do_sample: bool = False,
    temperature: float = 1.0,
    top_p: float = 1.0,
    seed: int = 0,
    progress: bool = True,
) -> dict:
    """Generate a response for every record not yet in `out_path`; returns counts `{written, skipped_long, done}`.

    Prompts whose chat-templated length exceeds `max_prompt_tokens` are skipped (truncating them would cut the
    generation prompt). Greedy by default; `do_sample=True` uses `temperature` / `top_p`. Each batch of
    `batch_size` prompts is built on the target's device.
    """
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    finished = done_ids(out_path)
    todo, skipped = [], 0
    for rec in records:
        if rec["id"] in finished:
            continue
        ids = chat_ids(tokenizer, rec["prompt"])
        if len(ids) > max_prompt_tokens:
            skipped += 1
            continue
        todo.append((rec, ids))
    eos = set(target.generation_config.eos_token_id if isinstance(target.generation_config.eos_token_id, list)
              else [target.generation_config.eos_token_id])
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else next(iter(eos))
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(todo), desc=f"regenerating {out_path.name}", unit="resp")
    torch.manual_seed(seed)
    written = 0
    for start in range(0, len(todo), batch_size):
        batch = todo[start : start + batch_size]
        width = max(len(ids) for _, ids in batch)
        input_ids = torch.tensor([[pad_id] * (width - len(ids)) + ids for _, ids in batch], device=target.device)
        attention_mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for _, ids in batch],
                                      device=target.device)
        with torch.no_grad():
            out_ids = target.generate(
                input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=max_new_tokens,
                do_sample=do_sample, temperature=temperature if do_sample else None,
                top_p=top_p if do_sample else None, top_k=None, pad_token_id=pad_id,
            )
        lines = []
        for (rec, _), row in zip(batch, out_ids[:, width:].tolist()):
            cut = next((i for i, t in enumerate(row) if t in eos), None)
            response = row if cut is None else row[:cut]
            line = {
                "id": rec["id"], "domain": rec.get("domain"), "prompt": rec["prompt"],
                "response": tokenizer.decode(response, skip_special_tokens=True),
                "num_tokens": len(response), "finish_reason": "length" if cut is None else "eos_token",
                # exact ids, so training sees the target's own tokenisation (EOS included when it stopped)
                "response_ids": row if cut is None else row[: cut + 1],
            }
            lines.append(json.dumps(line, ensure_ascii=False) + "\n")
        append_lines(out_path, lines)  # whole lines (for .gz, one whole gzip member), fsync'd
        written += len(batch)
        if bar is not None:
            bar.update(len(batch))
    if bar is not None:
        bar.close()
    return {"written": written, "skipped_long": skipped, "done": len(finished) + written}
