"""`angelspec` command line. `angelspec generate` is the main job: speculative generation on the embedded target,
printing the text, the mean accepted length and the speed-up over plain `generate`, measured side by side.
`angelspec regenerate` writes the target's own responses to TRAIN prompts (self-distillation data).
`angelspec prune-vocab` gives a drafter a pruned draft vocabulary (the target's most frequent reply tokens).
`angelspec serve` runs a TGI-compatible HTTP server on the batched speculative engine; its flags are the fields of
`ServeConfig` and its `EngineConfig` (`add_config_arguments`).
`angelspec demo` runs the Gradio Space (`spaces_demo/app.py`) locally.
`angelspec install-drafters` puts the shipped drafters into the local HF cache, where the commands above find them.
Every command that runs a model takes `--device` (auto: cuda when a GPU is visible, else cpu) and `--dtype` (auto:
float32 on cpu, bfloat16 on cuda); see `angelspec_hf.devices`."""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import typing
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


def _flag_type(kind, low=None, high=None):
    """argparse type: a value of `kind` (int, float or str), at least `low` and at most `high` when given (so a bad
    value is refused before any model loads, naming its flag)."""
    if kind is str:
        return str

    def convert(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {'an integer' if kind is int else 'a number'}, "
                                             f"got {text!r}") from None
        if low is not None and value < low:
            raise argparse.ArgumentTypeError(f"must be at least {low}, got {value}")
        if high is not None and value > high:
            raise argparse.ArgumentTypeError(f"must be at most {high}, got {value}")
        return value

    convert.__name__ = kind.__name__
    return convert


def _config_fields(cls):
    """`(field, annotation's types other than None)` per field of the dataclass `cls`."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        yield f, tuple(t for t in (typing.get_args(hints[f.name]) or (hints[f.name],)) if t is not type(None))


def add_config_arguments(parser, cls, title: str | None = None) -> None:
    """One flag per field of the dataclass `cls` (`EngineConfig`, `ServeConfig`): `--field-name` (and the aliases in
    `metadata["flags"]`), its help `metadata["help"]` with the default, its type the annotation's (a bool is
    `--x/--no-x`; `int | None` takes an int and defaults to None; `metadata["min"]`, `["max"]` and `["choices"]` are checked as
    the value is parsed). A field that is itself a dataclass adds its own fields, in a group of their own;
    `config_from_args` builds the config back."""
    group = parser.add_argument_group(title) if title else parser
    nested = []
    for f, kinds in _config_fields(cls):
        if dataclasses.is_dataclass(kinds[0]):
            nested.append((f, kinds[0]))
            continue
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        flags = ["--" + f.name.replace("_", "-"), *f.metadata.get("flags", ())]
        text = f.metadata["help"].replace("%", "%%")
        if default is not None and "default" not in text:
            text += f" (default: {({True: 'on', False: 'off'}.get(default, default))})"
        if bool in kinds:
            group.add_argument(*flags, dest=f.name, default=default, help=text,
                               action=argparse.BooleanOptionalAction)
            continue
        kind = next((k for k in (str, float, int) if k in kinds), str)
        group.add_argument(*flags, dest=f.name, default=default, help=text, choices=f.metadata.get("choices"),
                           type=_flag_type(kind, f.metadata.get("min"), f.metadata.get("max")),
                           metavar=f.metadata.get("metavar", "N" if kind is not str else None))
    for f, sub in nested:
        add_config_arguments(parser, sub, f"{f.name} settings ({sub.__name__}): {f.metadata.get('help', '')}")


def config_from_args(cls, args):
    """The `cls` config (`add_config_arguments`' dataclass) of the parsed `args`; `ValueError` from its validation."""
    return cls(**{f.name: config_from_args(kinds[0], args) if dataclasses.is_dataclass(kinds[0])
                  else getattr(args, f.name) for f, kinds in _config_fields(cls)})


def _time_generate(target, input_ids, **kwargs):
    """`(output, seconds)`, the seconds measured once the device has run the work (`clock`)."""
    from angelspec_hf.policy import clock

    start = clock(target.device)
    out = target.generate(input_ids, **kwargs)
    return out, clock(target.device) - start


def accepted_length_summary(runs) -> str:
    """The mean accepted length τ of `angelspec generate`'s speculative runs (their `SpeculationStats`), pooled over
    their verification rounds. A round verifies the drafter's block or, with `lookup_tokens`, a lookup (n-gram, or in
    the drafter's corpus); where
    no round verified a drafter's block (every step plain, or every round a lookup) it says "no drafter rounds" instead
    of a τ over nothing, followed by the lookups' τ when there were any."""
    from angelspec_hf.modeling.candidate_generator import mean_accepted_length

    rounds = sum(s.rounds for s in runs)
    lookups = sum(s.lookup_rounds for s in runs)
    corpus = sum(s.corpus_rounds for s in runs)
    kinds = f"lookups, {corpus} in the corpus" if corpus else "n-gram lookups"
    plain = sum(s.plain_steps for s in runs)
    tau = mean_accepted_length(sum(sum(s.accepted) for s in runs), rounds)
    where = f"in {len(runs)} run{'s' if len(runs) != 1 else ''}"
    plain_steps = f"{plain} plain step{'s' if plain != 1 else ''}, where drafting was not expected to pay"
    if rounds > lookups:
        text = f"{tau:.2f} tokens per target forward (bonus token included), over {rounds} rounds {where}"
        text += f" ({lookups} of them {kinds})" if lookups else ""
        return text + (f"; {plain_steps}" if plain else "")
    text = f"no drafter rounds {where}" + (f" ({plain_steps})" if plain else "")
    if lookups:
        return text + f"; {kinds}: {tau:.2f} tokens per target forward over {lookups} rounds"
    return text + "; no n-gram lookups either"


def cmd_generate(args) -> int:
    import torch

    import angelspec_hf
    from angelspec_hf.prompts import chat_input_ids

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    corpus = None
    if args.lookup_corpus and args.lookup_corpus != "none":  # read before the target loads: a wrong folder says so
        from angelspec_hf.policy import CorpusIndex

        try:
            corpus = CorpusIndex.from_path(args.lookup_corpus)
        except (FileNotFoundError, ValueError, KeyError) as error:
            print(f"angelspec generate: error: --lookup-corpus {args.lookup_corpus}: {error}", file=sys.stderr)
            return 2
    print(f"loading target: {args.target or angelspec_hf.targets.DEFAULT_TARGET} on {args.device} "
          f"({str(args.dtype).removeprefix('torch.')}) ...", flush=True)
    target, tokenizer = angelspec_hf.load_target(args.target, device=args.device, dtype=args.dtype)
    from angelspec_hf.shipped import NGRAM_LOOKUP_TOKENS, pick_drafter

    if args.drafter == "none":
        print("angelspec generate: error: --drafter none has nothing to compare; name a drafter", file=sys.stderr)
        return 2
    choice = pick_drafter(args.drafter, target)
    drafter = choice.drafter
    if drafter is not None and args.lookup_corpus:
        drafter.lookup_corpus = corpus
        if corpus is not None and not getattr(drafter.config, "lookup_tokens", 0):  # asked for: lookups on
            drafter.config.lookup_tokens = NGRAM_LOOKUP_TOKENS
    if choice.kind == "lookup":
        print(f"NOTE: {choice.note}.")
    elif choice.kind == "untrained":
        print(f"NOTE: {choice.note}: expect a mean accepted length near 1 and a slow-down. The output is still "
              "identical to plain generate, which is what this run checks.")
    else:
        print(f"drafter: {choice.note}")
    # n-gram lookup runs on transformers' own prompt-lookup path; a drafter through the generate() hook
    speculate = ({"assistant_model": drafter} if drafter is not None
                 else {"prompt_lookup_num_tokens": NGRAM_LOOKUP_TOKENS})
    kernels = use_linear_kernels(args.linear_kernels, target, drafter)
    input_ids = chat_input_ids(tokenizer, args.prompt, device=target.device)
    kwargs = dict(max_new_tokens=args.max_new_tokens, do_sample=False)

    _time_generate(target, input_ids[:, :8], max_new_tokens=4, do_sample=False)  # warm-up, both paths
    _time_generate(target, input_ids[:, :8], max_new_tokens=4, do_sample=False, **speculate)
    plain_times, spec_times, runs = [], [], []
    for _ in range(args.repeats):  # interleaved, so both see the same machine state
        plain, t_plain = _time_generate(target, input_ids, **kwargs)
        spec, t_spec = _time_generate(target, input_ids, **speculate, **kwargs)
        plain_times.append(t_plain)
        spec_times.append(t_spec)
        if drafter is not None:
            runs.append(drafter.last_speculation_stats)
        if not torch.equal(plain, spec):
            print("ERROR: speculative output differs from plain greedy output")
            return 1
    new_tokens = spec.shape[1] - input_ids.shape[1]
    t_plain, t_spec = statistics.median(plain_times), statistics.median(spec_times)
    print("\n--- generated text ---")
    print(tokenizer.decode(spec[0, input_ids.shape[1]:], skip_special_tokens=True))
    print("--- speculative decoding ---")
    if drafter is None:
        print(f"drafter            : none trained for this target: n-gram lookup, up to {NGRAM_LOOKUP_TOKENS} tokens "
              "per round (transformers' prompt lookup)")
    else:
        block = getattr(drafter.config, "block_size", None) or drafter.num_draft_tokens + 1
        print(f"drafter            : {type(drafter).__name__} ({args.drafter}), {drafter.num_draft_tokens} draft "
              f"tokens per round (block {block})")
        lookup_tokens = int(getattr(drafter.config, "lookup_tokens", 0) or 0)
        corpus = getattr(drafter, "lookup_corpus", None)
        print("lookups            : " + (f"up to {lookup_tokens} tokens, n-gram in the context" if lookup_tokens
                                          else "none (lookup_tokens 0)")
              + (f" and in a corpus of {corpus.num_sequences:,} earlier replies ({len(corpus):,} tokens)"
                 if lookup_tokens and corpus is not None else ""))
    timed = f"median of {args.repeats} runs" if args.repeats > 1 else "1 run"
    print(f"setting            : greedy (temperature 0), {new_tokens} new tokens, {timed}, "
          f"{describe_device(target.device)}, {str(target.dtype).removeprefix('torch.')}, {args.threads} CPU threads")
    print(f"linear kernels     : {kernels}, for both")
    print(f"identical to plain : yes ({args.repeats}/{args.repeats} runs)")
    print(f"mean accepted len  : {accepted_length_summary(runs) if runs else 'not reported by prompt lookup'}")
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
    """`angelspec serve`: the server `args.config` (a `ServeConfig`, every field a flag) describes, under uvicorn."""
    import math

    from angelspec_hf.tgi_patch.server import build_app, serve

    config = args.config
    from angelspec_hf.policy import CorpusIndex

    if config.lookup_corpus not in (None, "none") and not CorpusIndex.is_source(config.lookup_corpus):
        print(f"angelspec serve: error: argument --lookup-corpus: {config.lookup_corpus} holds no lookup corpus "
              "(lookup_corpus.safetensors, or regenerated replies: <set>.jsonl.gz or <set>.jsonl as `angelspec "
              "regenerate` writes them)", file=sys.stderr)
        return 2  # said before the target loads
    app, _ = build_app(config, log=lambda text: print(text, flush=True))
    # uvicorn's own grace outlasts the streams' (`graceful_shutdown_s`), so that they end cleanly
    serve(app, host=config.host, port=config.port, graceful_shutdown_s=math.ceil(config.graceful_shutdown_s) + 5)
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


# The example that ends each command's --help (argparse epilog); tests/test_cli.py parses every `angelspec` line.
EXAMPLES = {
    None: """\
examples:
  angelspec install-drafters     # in a checkout, once: the shipped drafters into the local HF cache
  angelspec generate             # the DFly drafter on the embedded SmolLM2-135M-Instruct, beside plain generate
  angelspec generate --target ./my-model --drafter ./runs/my-dfly
  angelspec serve --drafter dfly --port 8080""",
    "generate": """\
examples:
  angelspec generate                                  # DFly on the embedded SmolLM2-135M-Instruct
  angelspec generate --drafter mtp --prompt "Tell me about the moon." --max-new-tokens 128
  angelspec generate --target ./my-model --drafter ./runs/my-dfly --repeats 1""",
    "regenerate": """\
examples:
  angelspec regenerate --sets gsm8k,code_alpaca --limit 512
  angelspec regenerate --target ./my-model --sets gsm8k --limit 64 --max-new-tokens 128 --out ./my-model-data""",
    "serve": """\
examples:
  angelspec serve --drafter dfly --port 8080
  angelspec serve --drafter mtp --verify depth:3 --max-batch-size 8 --lookup-tokens 0 --no-measure-rates
  curl -s 127.0.0.1:8080/generate -H 'Content-Type: application/json' \\
       -d '{"inputs": "What is 12 * 7?", "parameters": {"max_new_tokens": 32}}'""",
    "demo": """\
example:
  angelspec demo --port 7860     # then open http://127.0.0.1:7860""",
    "install-drafters": """\
examples:
  angelspec install-drafters                                   # drafters/ of this checkout
  angelspec install-drafters --from path/to/drafters --families dfly""",
    "export": """\
examples:
  angelspec export dflash --format zlab --out ./dflash-zlab     # vLLM's and SGLang's DFlash layout
  angelspec export ./runs/my-mtp-eagle3 --format eagle3 --out ./mtp-eagle3""",
    "bench": """\
examples:
  angelspec bench --methods ar,prompt_lookup,dfly --sets humaneval --prompts-per-set 2 --temperatures 0
  angelspec bench --drafters dfly=./runs/my-dfly --methods ar,dfly --out ./bench-mine""",
    "prune-vocab": """\
example:
  angelspec prune-vocab --drafter dfly --size 8192 --out ./dfly-8k""",
}


class _CommandsFormatter(argparse.RawDescriptionHelpFormatter):
    """The top-level help: the examples as written, and each command's help on its own line beside it (before Python
    3.13 argparse measures sub-commands one indent short, which pushed the help of `install-drafters` to a line of its
    own)."""

    def add_argument(self, action):
        super().add_argument(action)
        if isinstance(action.choices, dict):  # the sub-commands
            longest = max(map(len, action.choices)) + self._current_indent + self._indent_increment
            self._action_max_length = max(self._action_max_length, longest)


def build_parser() -> argparse.ArgumentParser:
    """The `angelspec` parser: one subcommand per job, each `--help` ending with an example (`EXAMPLES`). `train`
    is parsed by `angelspec_hf.trainer.run` (every `TrainingArguments` flag)."""
    from angelspec_hf.bench import add_bench_parser
    from angelspec_hf.draft_vocab import add_prune_vocab_parser

    raw = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(
        prog="angelspec", formatter_class=_CommandsFormatter, epilog=EXAMPLES[None],
        description="Lossless speculative decoding for Hugging Face causal LMs with trained drafters (MTP, DFlash, "
                    "DFly).\nEvery command that runs a model takes --device (auto: cuda when a GPU is visible, else "
                    "cpu)\nand --dtype (auto: float32 on cpu, bfloat16 on cuda). `angelspec COMMAND --help` for more.")
    sub = parser.add_subparsers(dest="command", required=True, title="commands", metavar="COMMAND")

    gen = sub.add_parser("generate", help="speculative vs plain generate, side by side",
                         description="Speculative generation beside plain greedy generate on the same prompt, "
                         "interleaved: the text, the mean accepted length and the speed-up; fails if the outputs "
                         "differ.")
    gen.add_argument("--target", default=None, help="HF id or folder (default: the embedded SmolLM2-135M-Instruct)")
    gen.add_argument("--drafter", default="dfly",
                     help="mtp | dflash | dfly (the shipped drafter, by Hub id from the HF cache or from this checkout; "
                     "where none fits the target, n-gram lookup, with the reason) | untrained[:FAMILY] (random "
                     "weights, for experiments) | a folder/id")
    gen.add_argument("--prompt", default=DEFAULT_PROMPT)
    gen.add_argument("--lookup-corpus", default=None,
                     help="a lookup corpus for the drafter to look up in beside its n-gram lookups (turned on, 10 "
                          "tokens, where its `lookup_tokens` is 0): a lookup_corpus.safetensors, a drafter folder "
                          "holding one, or a folder of the target's regenerated replies (`angelspec regenerate`'s "
                          "output); 'none': n-gram lookups only (default: the drafter's own, from its folder)")
    gen.add_argument("--max-new-tokens", type=positive_int, default=64)
    gen.add_argument("--repeats", type=positive_int, default=3, help="runs of each; the times are their medians")
    gen.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 1))
    gen.add_argument("--seed", type=int, default=0)
    add_device_arguments(gen)
    add_linear_kernels_argument(gen)
    gen.set_defaults(func=cmd_generate)

    reg = sub.add_parser("regenerate", help="the target's own replies to TRAIN prompts",
                         description="The target's own responses to TRAIN prompts, the drafters' training data "
                         "(self-distillation): resumable, written to <out>/<set>.jsonl.gz (or appended to the "
                         "<set>.jsonl already there).")
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

    train = sub.add_parser("train", help="train a drafter (every TrainingArguments flag)", add_help=False)
    train.set_defaults(func=None)
    add_prune_vocab_parser(sub)
    add_bench_parser(sub)

    from angelspec_hf.tgi_patch.server.config import ServeConfig

    srv = sub.add_parser("serve", help="TGI-compatible HTTP server, batched, with D-Cut",
                         description="A TGI-compatible HTTP server on the batched speculative engine: continuous "
                         "batching, D-Cut verification budgets, streaming. Every flag is a field of ServeConfig or "
                         "of its EngineConfig (angelspec_hf.tgi_patch.server.ServeConfig).")
    add_config_arguments(srv, ServeConfig)
    srv.set_defaults(func=cmd_serve, config_class=ServeConfig)

    demo = sub.add_parser("demo", help="the Gradio Space, locally",
                          description="The Gradio Space, locally: plain and speculative generation side by side, "
                          "live.")
    demo.add_argument("--host", default="127.0.0.1")
    demo.add_argument("--port", type=int, default=None, help="default: 7860, or the next free port")
    demo.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 1))
    demo.add_argument("--share", action="store_true", help="a temporary public gradio.live link")
    add_device_arguments(demo)
    demo.set_defaults(func=cmd_demo)

    inst = sub.add_parser("install-drafters", help="the shipped drafters into the local HF cache",
                          description="Put the shipped drafters into the local HF cache under their Hub ids "
                          "(offline), where `generate`, `serve`, `bench` and the demo find them.")
    inst.add_argument("--from", dest="source", default=None,
                      help="folder holding smollm2-135m-instruct-{mtp,dflash,dfly}/ (default: drafters/ of this "
                      "checkout; the weights its weights.json lists are first written from git)")
    inst.add_argument("--cache-dir", default=None,
                      help="HF hub cache (default: $HF_HUB_CACHE, else $HF_HOME/hub, else ~/.cache/huggingface/hub)")
    inst.add_argument("--families", default="mtp,dflash,dfly")
    inst.set_defaults(func=cmd_install_drafters)

    exp = sub.add_parser("export", help="a drafter in vLLM's and SGLang's layout",
                         description="A drafter in the layout vLLM and SGLang serve (z-lab DFlash or EAGLE-3), "
                         "checked to load back unchanged.")
    exp.add_argument("drafter", nargs="?", default=None,
                     help="folder or Hub id, or mtp | dflash (the shipped one; default: the format's family)")
    exp.add_argument("--format", choices=("zlab", "eagle3"), default="zlab",
                     help="zlab: a DFlash drafter (default); eagle3: an MTP drafter trained with layout=eagle3")
    exp.add_argument("--target", default=None,
                     help="eagle3: the target whose LM head the export carries (default: the embedded SmolLM2)")
    exp.add_argument("--out", required=True, help="output folder")
    exp.set_defaults(func=cmd_export)

    for name, command in sub.choices.items():  # bench and prune-vocab are built beside their code
        if name in EXAMPLES:
            command.formatter_class, command.epilog = raw, EXAMPLES[name]
    return parser


def main(argv=None) -> int:
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    try:
        if args.command == "train":
            from angelspec_hf.trainer.run import main as train_main

            return train_main(rest)
        args = parser.parse_args(argv)
        if getattr(args, "config_class", None) is not None:  # refused before anything loads, naming the field
            try:
                args.config = config_from_args(args.config_class, args)
            except ValueError as error:  # the message starts with the field's name, the flag's
                field = str(error).split(" ", 1)[0]
                flag = f"argument --{field.replace('_', '-')}: " if hasattr(args, field) else ""
                print(f"angelspec {args.command}: error: {flag}{error}", file=sys.stderr)
                return 2
        if hasattr(args, "device"):  # resolved before any model loads: a missing GPU is said at once
            args.device = resolve_device(args.device)
            args.dtype = resolve_dtype(args.dtype, args.device)
        return args.func(args)
    except DeviceError as error:  # a device or dtype this machine cannot use: the message, no traceback
        print(f"angelspec {args.command}: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
