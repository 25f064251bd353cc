"""`angelspec` command line. `angelspec generate` is the main job: speculative generation on the embedded target,
printing the text, the mean accepted length and the speed-up over plain `generate`, measured side by side.
`angelspec regenerate` writes the target's own responses to TRAIN prompts (self-distillation data).
`angelspec prune-vocab` gives a drafter a pruned draft vocabulary (the target's most frequent reply tokens).
`angelspec serve` runs a TGI-compatible HTTP server on the batched speculative engine.
`angelspec demo` runs the Gradio Space (`spaces_demo/app.py`) locally."""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from pathlib import Path

DEFAULT_PROMPT = "Write a Python function that returns the n-th Fibonacci number, with a short docstring."


def _time_generate(target, input_ids, **kwargs):
    start = time.perf_counter()
    out = target.generate(input_ids, **kwargs)
    return out, time.perf_counter() - start


def cmd_generate(args) -> int:
    import torch

    import angelspec_hf
    from angelspec_hf.modeling import DRAFTERS
    from angelspec_hf.prompts import chat_input_ids

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    print(f"loading target: {args.target or angelspec_hf.targets.DEFAULT_TARGET} ...", flush=True)
    target, tokenizer = angelspec_hf.load_target(args.target)
    if args.drafter in DRAFTERS:
        from angelspec_hf.shipped import shipped_drafter_path, shipped_or_untrained

        why = []
        drafter, trained = shipped_or_untrained(args.drafter, target, why=why)
        if trained:
            print(f"drafter: shipped {args.drafter} drafter {shipped_drafter_path(args.drafter)}")
        else:
            print(
                f"NOTE: {why[0]}, so this {args.drafter} drafter is UNTRAINED (random weights): expect a mean "
                "accepted length near 1 and a slow-down. The output is still identical to plain generate, which "
                "is what this run checks."
            )
    else:
        drafter = angelspec_hf.load_drafter(args.drafter)
    input_ids = chat_input_ids(tokenizer, args.prompt)
    kwargs = dict(max_new_tokens=args.max_new_tokens, do_sample=False)

    _time_generate(target, input_ids[:, :8], max_new_tokens=4, do_sample=False)  # warm-up, both paths
    _time_generate(target, input_ids[:, :8], max_new_tokens=4, do_sample=False, assistant_model=drafter)
    plain_times, spec_times, taus = [], [], []
    for _ in range(args.repeats):  # interleaved, so both see the same machine state
        plain, t_plain = _time_generate(target, input_ids, **kwargs)
        spec, t_spec = _time_generate(target, input_ids, assistant_model=drafter, **kwargs)
        plain_times.append(t_plain)
        spec_times.append(t_spec)
        taus.append(drafter.last_speculation_stats.mean_accepted_length)
        if not torch.equal(plain, spec):
            print("ERROR: speculative output differs from plain greedy output")
            return 1
    new_tokens = spec.shape[1] - input_ids.shape[1]
    t_plain, t_spec = statistics.median(plain_times), statistics.median(spec_times)
    block = getattr(drafter.config, "block_size", None) or drafter.num_draft_tokens + 1
    print("\n--- generated text ---")
    print(tokenizer.decode(spec[0, input_ids.shape[1]:], skip_special_tokens=True))
    print("--- speculative decoding ---")
    print(f"drafter            : {type(drafter).__name__} ({args.drafter}), {drafter.num_draft_tokens} draft tokens "
          f"per round (block {block})")
    print(f"setting            : greedy (temperature 0), {new_tokens} new tokens, median of {args.repeats} runs, "
          f"{platform.machine()} CPU, {args.threads} threads")
    print(f"identical to plain : yes ({args.repeats}/{args.repeats} runs)")
    print(f"mean accepted len  : {statistics.median(taus):.2f} tokens per target forward (bonus token included)")
    print(f"plain generate     : {new_tokens / t_plain:.1f} tok/s ({t_plain:.2f} s)")
    print(f"speculative        : {new_tokens / t_spec:.1f} tok/s ({t_spec:.2f} s)")
    print(f"speed-up           : {t_plain / t_spec:.2f}x")
    return 0


def cmd_regenerate(args) -> int:
    import re

    import torch

    import angelspec_hf
    from angelspec_hf.trainer.data import load_train_prompts
    from angelspec_hf.trainer.regenerate import regenerate

    torch.set_num_threads(args.threads)
    target, tokenizer = angelspec_hf.load_target(args.target)
    slug = re.sub(r"[^a-z0-9]+", "-", (args.target or "smollm2-135m-instruct").lower()).strip("-")
    out_dir = Path(args.out or f"data/regenerated/{slug}")
    for name in args.sets.split(","):
        records = load_train_prompts(name)[: args.limit]
        stats = regenerate(
            target, tokenizer, records, out_dir / f"{name}.jsonl", batch_size=args.batch_size,
            max_new_tokens=args.max_new_tokens, max_prompt_tokens=args.max_prompt_tokens, do_sample=args.sample,
            temperature=args.temperature, top_p=args.top_p, seed=args.seed,
        )
        print(f"{name}: {stats}", flush=True)
    return 0


def cmd_serve(args) -> int:
    import torch

    import angelspec_hf
    from angelspec_hf.modeling import DRAFTERS
    from angelspec_hf.shipped import shipped_or_untrained
    from angelspec_hf.tgi_patch.engine import SpeculativeEngine
    from angelspec_hf.tgi_patch.server import create_app, serve

    torch.set_num_threads(args.threads)
    model_id = args.target or angelspec_hf.targets.DEFAULT_TARGET
    print(f"loading target: {model_id} ...", flush=True)
    target, tokenizer = angelspec_hf.load_target(args.target)
    trained = True
    if args.drafter == "none":
        drafter = None
    elif args.drafter in DRAFTERS:
        drafter, trained = shipped_or_untrained(args.drafter, target)
        if not trained:
            print(f"NOTE: no trained {args.drafter} drafter is shipped, so this one is UNTRAINED: outputs are still "
                  "the target's own, but expect a slow-down (the cost model falls back to plain steps).")
    else:
        drafter = angelspec_hf.load_drafter(args.drafter)
    if args.verify == "auto":
        print("cost model: the cached profile for this machine, or ~20 s of profiling ...", flush=True)
    engine = SpeculativeEngine(target, drafter, verify=args.verify, max_batch_size=args.max_batch_size)
    max_total = min(args.max_total_tokens, engine.max_total_tokens)
    app = create_app(
        engine, tokenizer, model_id,
        max_input_tokens=min(args.max_input_tokens, max_total - 1, engine.max_prefill_tokens),
        max_total_tokens=max_total, max_concurrent_requests=args.max_concurrent_requests,
        info_extra={"angelspec": {"drafter": args.drafter, "drafter_trained": trained, "verify": args.verify,
                                  "max_batch_size": args.max_batch_size}},
    )
    serve(app, host=args.host, port=args.port)
    return 0


def cmd_demo(args) -> int:
    try:
        from angelspec_hf.spaces_demo.app import main as demo_main
    except ImportError as error:
        raise ImportError(f"`angelspec demo` needs gradio and pandas ({error}); install them with "
                          "`pip install 'angelspec-hf[demo]'`") from error
    demo_main(host=args.host, port=args.port, threads=args.threads, share=args.share)
    return 0


def cmd_export(args) -> int:
    """Write a DFlash drafter in z-lab's Hub layout and check that it loads back unchanged."""
    import torch

    import angelspec_hf
    from angelspec_hf.modeling.converters import export_zlab_dflash
    from angelspec_hf.shipped import shipped_drafter_path

    source = str(shipped_drafter_path("dflash") or "") if args.drafter == "dflash" else args.drafter
    if not source:
        print("no shipped DFlash drafter: pass a folder or Hub id")
        return 1
    drafter = angelspec_hf.load_drafter(source)
    folder = export_zlab_dflash(drafter, args.out)
    back = angelspec_hf.load_drafter(str(folder), dtype=drafter.dtype)
    same = type(back) is type(drafter) and all(
        torch.equal(a, b) for a, b in zip(drafter.state_dict().values(), back.state_dict().values()))
    same = same and all(getattr(back.config, k) == getattr(drafter.config, k)
                        for k in ("block_size", "mask_token_id", "target_layer_ids", "num_hidden_layers"))
    print(f"wrote {folder} (z-lab DFlash layout); loads back unchanged: {'yes' if same else 'NO'}")
    return 0 if same else 1


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="angelspec", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="speculative generation vs plain generate, side by side")
    gen.add_argument("--target", default=None, help="HF id or folder (default: the embedded SmolLM2-135M-Instruct)")
    gen.add_argument("--drafter", default="dfly",
                     help="mtp | dflash | dfly (the shipped drafter; untrained where none ships) or a folder/id")
    gen.add_argument("--prompt", default=DEFAULT_PROMPT)
    gen.add_argument("--max-new-tokens", type=int, default=64)
    gen.add_argument("--repeats", type=int, default=3)
    gen.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 1))
    gen.add_argument("--seed", type=int, default=0)
    gen.set_defaults(func=cmd_generate)
    exp = sub.add_parser("export", help="a DFlash drafter in z-lab's Hub layout (served by vLLM and SGLang)")
    exp.add_argument("drafter", nargs="?", default="dflash", help="folder or Hub id (default: the shipped DFlash)")
    exp.add_argument("--out", required=True, help="output folder")
    exp.set_defaults(func=cmd_export)
    reg = sub.add_parser("regenerate", help="the target's own responses to TRAIN prompts (resumable jsonl)")
    reg.add_argument("--target", default=None, help="HF id or folder (default: the embedded SmolLM2-135M-Instruct)")
    reg.add_argument("--sets", default="code_alpaca,gsm8k,gpteacher_codegen,sharegpt,alpaca")
    reg.add_argument("--out", default=None, help="output folder (default: data/regenerated/<target>)")
    reg.add_argument("--limit", type=int, default=None, help="first N prompts of each set (a fixed random order)")
    reg.add_argument("--batch-size", type=int, default=16)
    reg.add_argument("--max-new-tokens", type=int, default=256)
    reg.add_argument("--max-prompt-tokens", type=int, default=512)
    reg.add_argument("--sample", action="store_true", help="sample instead of greedy decoding")
    reg.add_argument("--temperature", type=float, default=1.0)
    reg.add_argument("--top-p", type=float, default=1.0)
    reg.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 1))
    reg.add_argument("--seed", type=int, default=0)
    reg.set_defaults(func=cmd_regenerate)
    srv = sub.add_parser("serve", help="TGI-compatible HTTP server on the batched speculative engine (D-Cut)")
    srv.add_argument("--target", default=None, help="HF id or folder (default: the embedded SmolLM2-135M-Instruct)")
    srv.add_argument("--drafter", default="dfly",
                     help="mtp | dflash | dfly (the shipped one, else untrained) | none | a drafter folder/id")
    srv.add_argument("--verify", default="auto", help="auto (D-Cut + cost model) | N (budget per step) | depth:K")
    srv.add_argument("--host", default="127.0.0.1")
    srv.add_argument("--port", type=int, default=8080)
    srv.add_argument("--max-batch-size", type=int, default=32, help="requests decoded together")
    srv.add_argument("--max-concurrent-requests", type=int, default=128, help="beyond this: 429 overloaded")
    srv.add_argument("--max-input-tokens", type=int, default=1024)
    srv.add_argument("--max-total-tokens", type=int, default=2048, help="input + new tokens per request")
    srv.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 1))
    srv.set_defaults(func=cmd_serve)
    demo = sub.add_parser("demo", help="the Gradio Space, locally: plain vs speculative generation, live")
    demo.add_argument("--host", default="127.0.0.1")
    demo.add_argument("--port", type=int, default=None, help="default: 7860, or the next free port")
    demo.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 1))
    demo.add_argument("--share", action="store_true", help="a temporary public gradio.live link")
    demo.set_defaults(func=cmd_demo)
    from angelspec_hf.bench import add_bench_parser
    from angelspec_hf.draft_vocab import add_prune_vocab_parser

    add_bench_parser(sub)
    add_prune_vocab_parser(sub)
    train = sub.add_parser("train", help="train a drafter (all TrainingArguments flags; see --help)", add_help=False)
    train.set_defaults(func=None)
    args, rest = parser.parse_known_args(argv)
    if args.command == "train":
        from angelspec_hf.trainer.run import main as train_main

        return train_main(rest)
    return args.func(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
