"""`angelspec` command line. `angelspec generate` is the main job: speculative generation on the embedded target,
printing the text, the mean accepted length and the speed-up over plain `generate`, measured side by side.
`angelspec regenerate` writes the target's own responses to TRAIN prompts (self-distillation data).
`angelspec prune-vocab` gives a drafter a pruned draft vocabulary (the target's most frequent reply tokens).
`angelspec serve` runs a TGI-compatible HTTP server on the batched speculative engine.
`angelspec demo` runs the Gradio Space (`spaces_demo/app.py`) locally.
`angelspec install-drafters` puts the shipped drafters into the local HF cache, where the commands above find them.
Every command that runs a model takes `--device` (auto: cuda when a GPU is visible, else cpu) and `--dtype` (auto:
float32 on cpu, bfloat16 on cuda); see `angelspec_hf.devices`."""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

from angelspec_hf.cpu_kernels import add_linear_kernels_argument, use_linear_kernels
from angelspec_hf.devices import DeviceError, add_device_arguments, describe_device, resolve_device, resolve_dtype

DEFAULT_PROMPT = "Write a Python function that returns the n-th Fibonacci number, with a short docstring."


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1 (so a bad size is refused before the model loads)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _time_generate(target, input_ids, **kwargs):
    """`(output, seconds)`, the seconds measured once the device has run the work (`clock`)."""
    from angelspec_hf.modeling.draft_policy import clock

    start = clock(target.device)
    out = target.generate(input_ids, **kwargs)
    return out, clock(target.device) - start


def cmd_generate(args) -> int:
    import torch

    import angelspec_hf
    from angelspec_hf.modeling import DRAFTERS
    from angelspec_hf.prompts import chat_input_ids

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    print(f"loading target: {args.target or angelspec_hf.targets.DEFAULT_TARGET} on {args.device} "
          f"({str(args.dtype).removeprefix('torch.')}) ...", flush=True)
    target, tokenizer = angelspec_hf.load_target(args.target, device=args.device, dtype=args.dtype)
    from angelspec_hf.shipped import drafter_for_target, shipped_or_untrained

    if args.drafter in DRAFTERS:
        why = []
        drafter, trained = shipped_or_untrained(args.drafter, target, why=why)
        if trained:
            print(f"drafter: {why[0]}")
        else:
            print(
                f"NOTE: this {args.drafter} drafter is UNTRAINED (random weights): {why[0]}. Expect a mean "
                "accepted length near 1 and a slow-down. The output is still identical to plain generate, which "
                "is what this run checks."
            )
    else:
        drafter = drafter_for_target(args.drafter, target)
    kernels = use_linear_kernels(args.linear_kernels, target, drafter)
    input_ids = chat_input_ids(tokenizer, args.prompt, device=target.device)
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
          f"{describe_device(target.device)}, {str(target.dtype).removeprefix('torch.')}, {args.threads} CPU threads")
    print(f"linear kernels     : {kernels}, for both")
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
    from angelspec_hf.trainer.regenerated_files import output_file

    torch.set_num_threads(args.threads)
    target, tokenizer = angelspec_hf.load_target(args.target, device=args.device, dtype=args.dtype)
    slug = re.sub(r"[^a-z0-9]+", "-", (args.target or "smollm2-135m-instruct").lower()).strip("-")
    out_dir = Path(args.out or f"data/regenerated/{slug}")
    for name in args.sets.split(","):
        records = load_train_prompts(name)[: args.limit]
        stats = regenerate(
            target, tokenizer, records, output_file(out_dir, name), batch_size=args.batch_size,
            max_new_tokens=args.max_new_tokens, max_prompt_tokens=args.max_prompt_tokens, do_sample=args.sample,
            temperature=args.temperature, top_p=args.top_p, seed=args.seed,
        )
        print(f"{name}: {stats}", flush=True)
    return 0


def cmd_serve(args) -> int:
    import torch

    import angelspec_hf
    from angelspec_hf.modeling import DRAFTERS
    from angelspec_hf.shipped import drafter_for_target, shipped_or_untrained
    from angelspec_hf.tgi_patch.engine import SpeculativeEngine
    from angelspec_hf.tgi_patch.server import create_app, serve

    torch.set_num_threads(args.threads)
    model_id = args.target or angelspec_hf.targets.DEFAULT_TARGET
    print(f"loading target: {model_id} on {args.device} ({str(args.dtype).removeprefix('torch.')}) ...", flush=True)
    target, tokenizer = angelspec_hf.load_target(args.target, device=args.device, dtype=args.dtype)
    trained = True
    if args.drafter == "none":
        drafter = None
    elif args.drafter in DRAFTERS:
        why = []
        drafter, trained = shipped_or_untrained(args.drafter, target, why=why)
        if trained:
            print(f"drafter: {why[0]}")
        else:
            print(f"NOTE: this {args.drafter} drafter is UNTRAINED (random weights): {why[0]}. Outputs are still the "
                  "target's own, but expect a slow-down (the cost model falls back to plain steps).")
    else:
        drafter = drafter_for_target(args.drafter, target)
    kernels = use_linear_kernels(args.linear_kernels, target, drafter)
    print(f"linear kernels: {kernels}")
    if args.verify == "auto":
        print("cost model: the cached profile for this machine, or ~20 s of profiling ...", flush=True)
    engine = SpeculativeEngine(target, drafter, verify=args.verify, max_batch_size=args.max_batch_size,
                               kv_cache_tokens=args.kv_cache_tokens)
    max_total = min(args.max_total_tokens, engine.max_total_tokens)
    app = create_app(
        engine, tokenizer, model_id,
        max_input_tokens=min(args.max_input_tokens, max_total - 1, engine.max_prefill_tokens),
        max_total_tokens=max_total, max_concurrent_requests=args.max_concurrent_requests,
        max_stop_sequences=args.max_stop_sequences, max_stop_length=args.max_stop_length,
        max_payload_bytes=args.payload_limit, max_client_batch_size=args.max_client_batch_size,
        info_extra={"angelspec": {"drafter": args.drafter, "drafter_trained": trained, "verify": args.verify,
                                  "max_batch_size": args.max_batch_size, "linear_kernels": kernels,
                                  "device": str(target.device), "dtype": str(target.dtype).removeprefix("torch.")}},
    )
    serve(app, host=args.host, port=args.port)
    return 0


def cmd_demo(args) -> int:
    try:
        from angelspec_hf.spaces_demo.app import main as demo_main
    except ImportError as error:
        raise ImportError(f"`angelspec demo` needs gradio and pandas ({error}); install them with "
                          "`pip install 'angelspec-hf[demo]'`") from error
    demo_main(host=args.host, port=args.port, threads=args.threads, share=args.share, device=args.device,
              dtype=args.dtype)
    return 0


def cmd_install_drafters(args) -> int:
    """Put the shipped drafters into the local HF cache under their Hub ids (no network), so an installed package
    loads them by id; checked with huggingface_hub's offline resolution."""
    from angelspec_hf.hub_cache import hub_cache_dir
    from angelspec_hf.shipped import install_shipped
    from angelspec_hf.weights_store import WeightsStoreError

    families = [f for f in args.families.split(",") if f]
    try:
        installed = install_shipped(args.source, args.cache_dir, families)  # writes a checkout's weights from git
    except (FileNotFoundError, ValueError, WeightsStoreError) as error:
        print(f"cannot install the shipped drafters: {error}")
        return 1
    print(f"HF cache: {hub_cache_dir(args.cache_dir)}")
    for repo_id, snapshot, revision, changed in installed:
        print(f"{repo_id}: revision {revision[:12]} ({'installed' if changed else 'already there'}) -> {snapshot}")
    return 0


def cmd_export(args) -> int:
    """Write a drafter in a serving engine's layout and check that it loads back unchanged: a DFlash drafter in
    z-lab's (`--format zlab`), an MTP drafter with `layout="eagle3"` in EAGLE-3's (`--format eagle3`, which also needs
    the target, whose LM head rows the export carries)."""
    import torch

    import angelspec_hf
    from angelspec_hf.modeling import DRAFTERS
    from angelspec_hf.modeling.converters import check_eagle_exportable, export_eagle, export_zlab_dflash
    from angelspec_hf.shipped import shipped_drafter_path

    source = args.drafter or {"zlab": "dflash", "eagle3": "mtp"}[args.format]
    if source in DRAFTERS:
        source = str(shipped_drafter_path(source) or "")
        if not source:
            print(f"no shipped {args.drafter or args.format} drafter: pass a folder or Hub id")
            return 1
    drafter = angelspec_hf.load_drafter(source)
    try:
        if args.format == "zlab":
            folder, keys = export_zlab_dflash(drafter, args.out), ("block_size", "mask_token_id")
        else:
            from transformers import AutoModelForCausalLM

            check_eagle_exportable(drafter)  # before loading the target
            target = (AutoModelForCausalLM.from_pretrained(args.target) if args.target
                      else angelspec_hf.load_default_target()[0])
            folder, keys = export_eagle(drafter, args.out, target), ("layout", "draft_vocab_size", "num_draft_tokens")
    except ValueError as error:
        print(f"cannot export {source}: {error}")
        return 1
    back = angelspec_hf.load_drafter(str(folder), dtype=drafter.dtype)
    mine, theirs = drafter.state_dict(), back.state_dict()
    same = type(back) is type(drafter) and mine.keys() == theirs.keys() and all(
        torch.equal(mine[k], theirs[k]) for k in mine)
    same = same and all(getattr(back.config, k) == getattr(drafter.config, k)
                        for k in keys + ("target_layer_ids", "num_hidden_layers"))
    layout = {"zlab": "z-lab DFlash", "eagle3": "EAGLE-3 (vLLM / SGLang)"}[args.format]
    print(f"wrote {folder} ({layout} layout); loads back unchanged: {'yes' if same else 'NO'}")
    return 0 if same else 1


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="angelspec", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="speculative generation vs plain generate, side by side")
    gen.add_argument("--target", default=None, help="HF id or folder (default: the embedded SmolLM2-135M-Instruct)")
    gen.add_argument("--drafter", default="dfly",
                     help="mtp | dflash | dfly (the shipped drafter, by Hub id from the HF cache or from this checkout; "
                     "untrained, with the reason, where none is found) or a folder/id")
    gen.add_argument("--prompt", default=DEFAULT_PROMPT)
    gen.add_argument("--max-new-tokens", type=int, default=64)
    gen.add_argument("--repeats", type=int, default=3)
    gen.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 1))
    gen.add_argument("--seed", type=int, default=0)
    add_device_arguments(gen)
    add_linear_kernels_argument(gen)
    gen.set_defaults(func=cmd_generate)
    inst = sub.add_parser("install-drafters", help="put the shipped drafters into the local HF cache under their "
                          "Hub ids (offline), where `generate`, `serve`, `bench` and the demo find them")
    inst.add_argument("--from", dest="source", default=None,
                      help="folder holding smollm2-135m-instruct-{mtp,dflash,dfly}/ (default: drafters/ of this "
                      "checkout; the weights its weights.json lists are first written from git)")
    inst.add_argument("--cache-dir", default=None,
                      help="HF hub cache (default: $HF_HUB_CACHE, else $HF_HOME/hub, else ~/.cache/huggingface/hub)")
    inst.add_argument("--families", default="mtp,dflash,dfly")
    inst.set_defaults(func=cmd_install_drafters)
    exp = sub.add_parser("export", help="a drafter in the layout vLLM and SGLang serve (z-lab DFlash or EAGLE-3)")
    exp.add_argument("drafter", nargs="?", default=None,
                     help="folder or Hub id, or mtp | dflash (the shipped one; default: the format's family)")
    exp.add_argument("--format", choices=("zlab", "eagle3"), default="zlab",
                     help="zlab: a DFlash drafter (default); eagle3: an MTP drafter trained with layout=eagle3")
    exp.add_argument("--target", default=None,
                     help="eagle3: the target whose LM head the export carries (default: the embedded SmolLM2)")
    exp.add_argument("--out", required=True, help="output folder")
    exp.set_defaults(func=cmd_export)
    reg = sub.add_parser("regenerate", help="the target's own responses to TRAIN prompts (resumable; "
                         "<set>.jsonl.gz, or the <set>.jsonl already there)")
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
    add_device_arguments(reg)
    reg.set_defaults(func=cmd_regenerate)
    srv = sub.add_parser("serve", help="TGI-compatible HTTP server on the batched speculative engine (D-Cut)")
    srv.add_argument("--target", default=None, help="HF id or folder (default: the embedded SmolLM2-135M-Instruct)")
    srv.add_argument("--drafter", default="dfly",
                     help="mtp | dflash | dfly (the shipped one, else untrained) | none | a drafter folder/id")
    srv.add_argument("--verify", default="auto", help="auto (D-Cut + cost model) | N (budget per step) | depth:K")
    srv.add_argument("--host", default="127.0.0.1")
    srv.add_argument("--port", type=int, default=8080)
    srv.add_argument("--max-batch-size", type=positive_int, default=32, help="requests decoded together")
    srv.add_argument("--max-concurrent-requests", type=int, default=128, help="beyond this: 429 overloaded")
    srv.add_argument("--kv-cache-tokens", type=positive_int, default=None,
                     help="tokens the KV pools hold before they grow (default: 1024 per --max-batch-size)")
    srv.add_argument("--max-input-tokens", type=int, default=1024)
    srv.add_argument("--max-total-tokens", type=int, default=2048, help="input + new tokens per request")
    srv.add_argument("--max-stop-sequences", type=int, default=4)
    srv.add_argument("--max-stop-length", type=int, default=256, help="characters per stop string")
    srv.add_argument("--payload-limit", type=int, default=2_000_000, help="request body bytes (TGI's flag)")
    srv.add_argument("--max-client-batch-size", type=int, default=4, help="prompts per /v1/completions request")
    srv.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 1))
    add_device_arguments(srv)
    add_linear_kernels_argument(srv)
    srv.set_defaults(func=cmd_serve)
    demo = sub.add_parser("demo", help="the Gradio Space, locally: plain vs speculative generation, live")
    demo.add_argument("--host", default="127.0.0.1")
    demo.add_argument("--port", type=int, default=None, help="default: 7860, or the next free port")
    demo.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 1))
    demo.add_argument("--share", action="store_true", help="a temporary public gradio.live link")
    add_device_arguments(demo)
    demo.set_defaults(func=cmd_demo)
    from angelspec_hf.bench import add_bench_parser
    from angelspec_hf.draft_vocab import add_prune_vocab_parser

    add_bench_parser(sub)
    add_prune_vocab_parser(sub)
    train = sub.add_parser("train", help="train a drafter (all TrainingArguments flags; see --help)", add_help=False)
    train.set_defaults(func=None)
    args, rest = parser.parse_known_args(argv)
    try:
        if args.command == "train":
            from angelspec_hf.trainer.run import main as train_main

            return train_main(rest)
        args = parser.parse_args(argv)
        if hasattr(args, "device"):  # resolved before any model loads: a missing GPU is said at once
            args.device = resolve_device(args.device)
            args.dtype = resolve_dtype(args.dtype, args.device)
        return args.func(args)
    except DeviceError as error:  # a device or dtype this machine cannot use: the message, no traceback
        print(f"angelspec {args.command}: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
