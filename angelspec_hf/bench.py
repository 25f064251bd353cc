"""`angelspec bench`: speculative methods side by side on the same prompts, interleaved in one run.

For every prompt (chat template applied) and temperature, each method generates in turn: plain AR `generate`,
transformers' prompt lookup, transformers' built-in DFlash path with our DFlash drafter, and our `generate()` hook
with the MTP, DFlash and DFly drafters, and the router (each request to MTP or DFly, see `angelspec_hf.router`). τ is counted the same way for every method: tokens gained per target forward
after the prefill (a forward hook counts the target's forwards; AR gives exactly 1). Greedy outputs must equal AR's token for token; a
mismatch is reported and makes the command exit non-zero, except, for a bf16 / fp16 target, one that parts from AR's
output only at a precision tie (`identity.py`), which is reported as such. Writes `results.json`, `results.md` and PNG plots.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

from angelspec_hf.cpu_kernels import add_linear_kernels_argument, stock_linears, use_linear_kernels
from angelspec_hf.devices import add_device_arguments, describe_device
from angelspec_hf.identity import IdentityJudge, identity_label
from angelspec_hf.policy import clock
from angelspec_hf.prompts import EVAL_SETS, chat_input_ids, load_eval_prompts


METHODS = ("ar", "ar_stock", "prompt_lookup", "dflash_builtin", "mtp", "mtp_full", "mtp+lookup", "dflash", "dflash_full",
           "dflash+lookup", "dfly", "dfly_full", "dfly+lookup", "dfly+corpus", "router")
# `ar_stock`: plain `generate` with the stock `F.linear` kernels where the target's linears are prepacked
# (`--linear-kernels`, `angelspec_hf.cpu_kernels`): what prepacking gains before any speculation; every other method
# runs on the same (prepacked) target as `ar`, the reference of every speed-up and of greedy identity.
# `<family>`: the drafter with its cost-aware draft length (`draft_length="auto"`); `<family>_full`: whole blocks,
# cut where the drafter's `draft_stop_threshold` says (the shipped DFly's 0.4; `--draft-stop-threshold 0`: uncut);
# `<family>+lookup` (also `<label>+lookup` for a drafter of --drafters): each round an n-gram lookup, the drafter's
# block or a plain step, whichever is expected to give the most tokens per second (`lookup_tokens`);
# `<family>_full+lookup`: whole blocks, and a lookup whenever one matches (not in the default list);
# `<family>+corpus` (also `<label>+corpus`): `+lookup`, and lookups in the drafter's corpus of the target's earlier
# outputs (`drafter.lookup_corpus`: the shipped drafters' is `shipped_lookup_corpus()`; `--lookup-corpus` gives one to
# every drafter), the better-expected of the two lookups taking the round; `+lookup` and the others run without it
LOOKUP = "+lookup"
CORPUS = "+corpus"
LOOKUP_TOKENS = 10
DRAFTER_OF = {"dflash_builtin": "dflash", "mtp": "mtp", "dflash": "dflash", "dfly": "dfly", "router": "router",
              "mtp_full": "mtp", "dflash_full": "dflash", "dfly_full": "dfly"}
HOOK_METHODS = ("mtp", "mtp_full", "mtp+lookup", "dflash", "dflash_full", "dflash+lookup", "dfly", "dfly_full",
                "dfly+lookup", "dfly+corpus", "router")


class ForwardCounter:
    """Counts the target's forward passes (one per AR step or per verification)."""

    def __init__(self, model):
        self.count = 0
        self._handle = model.register_forward_hook(self._hook)

    def _hook(self, *args):
        self.count += 1

    def close(self):
        self._handle.remove()


def drafter_of(method: str) -> str:
    """The drafter a method uses: its family, or (an extra `--drafters label=path` entry) the label itself."""
    base = method.removesuffix(LOOKUP).removesuffix(CORPUS)
    return DRAFTER_OF.get(base, base)


def method_order(method: str) -> tuple:
    return (METHODS.index(method), "") if method in METHODS else (len(METHODS), method)


class ForwardTimer:
    """Seconds spent inside the target's forward passes (verification, or the plain step)."""

    def __init__(self, model):
        self.seconds, self._start, self._device = 0.0, None, model.device
        self._handles = [model.register_forward_pre_hook(self._pre), model.register_forward_hook(self._post)]

    def _pre(self, *args):
        self._start = clock(self._device)

    def _post(self, *args):
        self.seconds += clock(self._device) - self._start

    def close(self):
        for handle in self._handles:
            handle.remove()


def method_kwargs(method: str, drafters: dict, corpora: dict | None = None) -> dict:
    """`generate()`'s keyword arguments for `method`, the drafter's config set for it. `corpora`: label -> the
    `CorpusIndex` its `+corpus` method looks up in (every other method runs without one)."""
    if method in ("ar", "ar_stock"):
        return {}
    if method == "prompt_lookup":
        return {"prompt_lookup_num_tokens": 10}
    label = drafter_of(method)
    drafter = drafters[label]
    if method == "router":  # each routed drafter cost-aware and with n-gram lookups, whatever method ran before it
        for routed in drafter.drafters.values():
            routed.config.draft_length, routed.config.lookup_tokens = "auto", LOOKUP_TOKENS
            routed.lookup_corpus = None
    elif method != "dflash_builtin" and hasattr(drafter, "config"):
        base = method.removesuffix(LOOKUP).removesuffix(CORPUS)
        drafter.config.draft_length = "full" if base.endswith("_full") else "auto"
        drafter.config.lookup_tokens = LOOKUP_TOKENS if method.endswith((LOOKUP, CORPUS)) else 0
        drafter.lookup_corpus = (corpora or {}).get(label) if method.endswith(CORPUS) else None
    kwargs = {"assistant_model": drafter}
    if method == "dflash_builtin":
        kwargs["speculation_type"] = "dflash"
    return kwargs


def set_stop_threshold(drafters: dict, threshold: float | None) -> None:
    """`--draft-stop-threshold`: give every drafter (the router's too) the same cut of its `_full` drafts (0: whole
    blocks), so drafters are compared on the same footing; None keeps each drafter's own. Raises `ValueError` outside
    [0, 1)."""
    if threshold is None:
        return
    if not 0.0 <= threshold < 1.0:
        raise ValueError(f"--draft-stop-threshold must be in [0, 1), got {threshold}")
    for label, drafter in drafters.items():
        for d in drafter.drafters.values() if label == "router" else (drafter,):
            if hasattr(d, "config"):
                d.config.draft_stop_threshold = threshold


def load_prompt_sets(sets, per_set: int, prompts_file: str | None) -> dict[str, list[str]]:
    if prompts_file:
        with open(prompts_file, encoding="utf-8") as f:
            return {Path(prompts_file).stem: [json.loads(line)["prompt"] for line in f if line.strip()][:per_set]}
    return {name: load_eval_prompts(name, per_set) for name in sets}


def greedy_identity(judge, ids, reference, out) -> dict:
    """`identical` and `tie` of one greedy output against AR's (`IdentityJudge`), with where and why they part."""
    n = ids.shape[1]
    verdict = judge(ids[0].tolist(), reference[0, n:].tolist(), out[0, n:].tolist())
    return {"identical": verdict["identical"], "tie": verdict["tie"],
            "divergence": None if verdict["identical"] else {k: verdict[k] for k in ("position", "tokens", "margin",
                                                                                      "noise")}}


def run_bench(target, tokenizer, drafters: dict, methods, prompt_sets: dict, temperatures=(0.0,),
              max_new_tokens: int = 128, seed: int = 0, corpora: dict | None = None) -> list[dict]:
    """One record per (set, prompt, temperature, method): new tokens, seconds, target forwards, τ, identical.
    `corpora`: as `method_kwargs` takes it (default: each drafter's own `lookup_corpus`, as loaded)."""
    if corpora is None:
        corpora = {label: getattr(d, "lookup_corpus", None) for label, d in drafters.items()}
    records = []
    counter, timer = ForwardCounter(target), ForwardTimer(target)
    judge = IdentityJudge(target)
    try:
        warm = chat_input_ids(tokenizer, "Hi", device=target.device)
        for method in methods:  # warm every path once, so no method is timed cold
            target.generate(warm, max_new_tokens=4, do_sample=False, **method_kwargs(method, drafters, corpora))
        total, done, began = sum(map(len, prompt_sets.values())) * len(temperatures), 0, time.perf_counter()
        for set_name, prompts in prompt_sets.items():
            for index, prompt in enumerate(prompts):
                ids = chat_input_ids(tokenizer, prompt, device=target.device)
                for temperature in temperatures:
                    if done:  # progress on long runs, on stderr (stdout keeps the table)
                        left = (time.perf_counter() - began) / done * (total - done)
                        print(f"[bench] {done}/{total} prompt-temperature pairs done, ~{left / 60:.0f} min left",
                              file=sys.stderr, flush=True)
                    done += 1
                    sampling = dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0) if temperature > 0 \
                        else dict(do_sample=False)
                    reference = None
                    for method in methods:
                        torch.manual_seed(seed + index)
                        counter.count, timer.seconds = 0, 0.0
                        with stock_linears(target, method == "ar_stock"):
                            start = clock(target.device)
                            out = target.generate(ids, max_new_tokens=max_new_tokens, **sampling,
                                                  **method_kwargs(method, drafters, corpora))
                            seconds = clock(target.device) - start
                        new = out.shape[1] - ids.shape[1]
                        forwards, forward_seconds = counter.count, timer.seconds  # (before the judge's forwards)
                        if method == "ar":
                            reference = out
                        identity = {"identical": None, "tie": None} if temperature else greedy_identity(
                            judge, ids, reference, out)
                        stats = getattr(drafters.get(drafter_of(method)), "last_speculation_stats", None)
                        hook = stats is not None and method not in ("ar", "ar_stock", "prompt_lookup", "dflash_builtin")
                        records.append({
                            "set": set_name, "prompt": index, "temperature": temperature, "method": method,
                            "new_tokens": new, "seconds": seconds, "target_forwards": forwards,
                            # the prefill yields one token; every later forward yields accepted + 1
                            "tau": (new - 1) / (forwards - 1) if forwards > 1 else 1.0,
                            **identity,
                            "accepted_per_round": list(stats.accepted) if hook else None,
                            "plain_steps": stats.plain_steps if hook else None,
                            "lookup_rounds": stats.lookup_rounds if hook else None,
                            "corpus_rounds": stats.corpus_rounds if hook else None,
                            # where the time went: target forwards, drafting (hook methods), the rest
                            "forward_seconds": forward_seconds,
                            "draft_seconds": stats.draft_seconds if hook else None,
                        })
    finally:
        counter.close()
        timer.close()
    return records


def paired_ratio_interval(pairs, level: float = 0.95, draws: int = 4000, seed: int = 0) -> tuple[float, float]:
    """Percentile bootstrap over prompts of a ratio of pooled ratios, `(Σ n / Σ d) / (Σ n' / Σ d')`, where each row of
    `pairs` is one prompt's `[n, d, n', d']` (the compared method's numerator and denominator, then the baseline's on
    the same prompt): prompts are drawn with replacement and both sides pooled over the same draw, so the prompts' own
    difficulty cancels and the interval is the spread that comes from which prompts a set happens to hold."""
    import numpy as np

    pairs = np.asarray(pairs, dtype=float)
    idx = np.random.default_rng(seed).integers(0, len(pairs), size=(draws, len(pairs)))
    n, d, n0, d0 = pairs[idx].sum(1).T  # each [draws]
    lo, hi = np.quantile((n / d) / (n0 / d0), [(1 - level) / 2, (1 + level) / 2])
    return float(lo), float(hi)


def speedup_interval(rs: list[dict], ar: list[dict], level: float = 0.95, draws: int = 4000,
                     seed: int = 0) -> tuple[float, float]:
    """Percentile bootstrap over prompts of the total speed-up `tps(rs) / tps(ar)` (`paired_ratio_interval`), each
    prompt with the AR run of the same prompt (`rs[i]` pairs with `ar[i]`): the yardstick for "within noise" when a
    cell reads 0.95x."""
    return paired_ratio_interval([[r["new_tokens"], r["seconds"], a["new_tokens"], a["seconds"]]
                                  for r, a in zip(rs, ar)], level, draws, seed)


def summarise(records: list[dict]) -> list[dict]:
    """Per (set, temperature, method): τ, tokens/s and speed-up over AR from totals of the same prompts; with several
    sets, also "all" (every prompt: a mixed workload, where per-request routing should beat either drafter alone)."""
    groups = defaultdict(list)
    several = len({r["set"] for r in records}) > 1
    for r in records:
        groups[(r["set"], r["temperature"], r["method"])].append(r)
        if several:
            groups[("all", r["temperature"], r["method"])].append(r)
    rows = []
    for (set_name, temperature, method), rs in groups.items():
        ar = groups[(set_name, temperature, "ar")]
        tps = sum(r["new_tokens"] for r in rs) / sum(r["seconds"] for r in rs)
        ar_tps = sum(r["new_tokens"] for r in ar) / sum(r["seconds"] for r in ar)
        forwards = max(sum(r["target_forwards"] for r in rs), 1)
        ar_step = sum(r["seconds"] for r in ar) / max(sum(r["target_forwards"] for r in ar), 1)  # one AR step
        draft = sum(r["draft_seconds"] or 0.0 for r in rs)
        verify = sum(r["forward_seconds"] for r in rs)
        rows.append({
            "set": set_name, "temperature": temperature, "method": method, "prompts": len(rs),
            # one round (= one target forward) in plain decode steps: drafting, the target forward, everything else
            "round_draft": draft / forwards / ar_step,
            "round_verify": verify / forwards / ar_step,
            "round_overhead": (sum(r["seconds"] for r in rs) - draft - verify) / forwards / ar_step,
            "tau": sum(r["new_tokens"] - 1 for r in rs) / max(sum(r["target_forwards"] - 1 for r in rs), 1),
            "tokens_per_s": tps, "speedup": tps / ar_tps, "speedup_ci95": speedup_interval(rs, ar),
            "median_speedup": statistics.median(
                (r["new_tokens"] / r["seconds"]) / (a["new_tokens"] / a["seconds"]) for r, a in zip(rs, ar)),
            "identical": None if temperature else all(r["identical"] for r in rs),
            # prompts whose output parted from AR's only at a precision tie (bf16 / fp16), and elsewhere
            "ties": None if temperature else sum(bool(r.get("tie")) for r in rs),
            "divergent": None if temperature else sum(not r["identical"] and not r.get("tie") for r in rs),
        })
    return rows


def acceptance_by_position(records: list[dict]) -> dict[str, list[float]]:
    """Per drafter method: P(draft position k accepted) over all rounds (k = 1, 2, ...)."""
    curves = {}
    for method in sorted({r["method"] for r in records if r["accepted_per_round"]}, key=method_order):
        rounds = [a for r in records if r["method"] == method and r["accepted_per_round"] for a in r["accepted_per_round"]]
        if rounds:
            depth = max(max(rounds), 1)
            curves[method] = [sum(a >= k for a in rounds) / len(rounds) for k in range(1, depth + 1)]
    return curves


def overview_table(rows: list[dict]) -> list[str]:
    """One line per method, one column per (set, temperature): "speed-up (τ)", with the round's split at the lowest
    temperature over every prompt - the compact form of the long table below it."""
    sets = list(dict.fromkeys(r["set"] for r in rows if r["set"] != "all"))  # in the order they ran
    temps = sorted({r["temperature"] for r in rows})
    cells = {(r["method"], r["set"], r["temperature"]): r for r in rows}
    pooled = "all" if len(sets) > 1 else sets[0]
    lines = ["| method | " + " | ".join(f"{s} T={t:g}" for t in temps for s in sets)
             + f" | round at T={temps[0]:g}: draft + forward + rest (AR steps) |",
             "|---|" + "---|" * (len(sets) * len(temps) + 1)]
    for method in sorted({r["method"] for r in rows}, key=method_order):
        row = [f"{c['speedup']:.2f}x ({c['tau']:.2f})" if (c := cells.get((method, s, t))) else "" for t in temps
               for s in sets]
        split = cells.get((method, pooled, temps[0]))
        row.append(f"{split['round_draft']:.2f} + {split['round_verify']:.2f} + {split['round_overhead']:.2f}"
                   if split else "")
        lines.append(f"| {method} | " + " | ".join(row) + " |")
    return lines


def write_outputs(records, rows, out_dir, meta: dict) -> dict[str, Path]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({"meta": meta, "summary": rows, "records": records}, indent=1))
    lines = [f"# angelspec bench\n\n{meta['setting']}\n", "Speed-up over `ar` from totals (τ):\n",
             *overview_table(rows), "", "Every cell:\n",
             "| set | T | method | prompts | τ | tok/s | speed-up (total) | 95% interval over prompts | speed-up (median) "
             "| greedy identical | round: draft + forward + rest (AR steps) |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: (r["set"], r["temperature"], method_order(r["method"]))):
        same = "—" if r["identical"] is None else identity_label(r["identical"], r["ties"], r["divergent"]).replace(
            "NO", "**NO**")
        split = f"{r['round_draft']:.2f} + {r['round_verify']:.2f} + {r['round_overhead']:.2f}"
        lo, hi = r["speedup_ci95"]
        lines.append(f"| {r['set']} | {r['temperature']:g} | {r['method']} | {r['prompts']} | {r['tau']:.2f} | "
                     f"{r['tokens_per_s']:.1f} | {r['speedup']:.2f}x | {lo:.2f}–{hi:.2f}x | {r['median_speedup']:.2f}x | "
                     f"{same} | {split} |")
    (out / "results.md").write_text("\n".join(lines) + "\n")
    paths = {"json": out / "results.json", "markdown": out / "results.md"}
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    for temperature in sorted({r["temperature"] for r in rows}):
        sub = [r for r in rows if r["temperature"] == temperature]
        sets = sorted({r["set"] for r in sub})
        methods = sorted({r["method"] for r in sub}, key=method_order)
        fig, ax = plt.subplots(figsize=(1.8 + 1.4 * len(sets), 3.6))
        width = 0.8 / len(methods)
        for i, m in enumerate(methods):
            cells = [next((r for r in sub if r["set"] == s and r["method"] == m), None) for s in sets]
            values = [c["speedup"] if c else 0 for c in cells]
            errors = [[c["speedup"] - c["speedup_ci95"][0] if c else 0 for c in cells],
                      [c["speedup_ci95"][1] - c["speedup"] if c else 0 for c in cells]]
            ax.bar([x + i * width for x in range(len(sets))], values, width, yerr=errors, capsize=2, label=m)
        ax.axhline(1.0, color="black", lw=0.8)
        ax.set_xticks([x + 0.4 - width / 2 for x in range(len(sets))], sets)
        ax.set_ylabel("speed-up over AR")
        ax.set_title(f"T={temperature:g}")
        ax.legend(fontsize=7)
        fig.tight_layout()
        paths[f"speedup_T{temperature:g}"] = out / f"speedup_T{temperature:g}.png"
        fig.savefig(paths[f"speedup_T{temperature:g}"], dpi=120)
        plt.close(fig)
    curves = acceptance_by_position(records)
    if curves:
        fig, ax = plt.subplots(figsize=(4.5, 3.4))
        for method, curve in curves.items():
            ax.plot(range(1, len(curve) + 1), curve, marker="o", label=method)
        ax.set_xlabel("draft position k")
        ax.set_ylabel("P(accepted)")
        ax.set_ylim(0, 1)
        ax.legend()
        fig.tight_layout()
        paths["acceptance"] = out / "acceptance_by_position.png"
        fig.savefig(paths["acceptance"], dpi=120)
        plt.close(fig)
    return paths


def bench_main(args) -> int:
    import angelspec_hf
    from angelspec_hf.shipped import drafter_for_target, shipped_or_untrained

    torch.set_num_threads(args.threads)
    methods = sorted(args.methods.split(","), key=method_order)  # "ar" first: the reference of the others
    if args.concurrency:
        methods = [m for m in methods if m in ("mtp", "dflash", "dfly")] + ["ar"]
    given = dict(item.split("=", 1) for item in args.drafters.split(",") if item) if args.drafters else {}
    extra = {m + LOOKUP for m in HOOK_METHODS if m.endswith("_full")} | {"mtp" + CORPUS, "dflash" + CORPUS}
    unknown = (set(methods) - set(METHODS) - extra - set(given) - {label + LOOKUP for label in given}
               - {label + CORPUS for label in given})
    if unknown or "ar" not in methods:
        raise SystemExit(f"--methods must include 'ar' and come from {METHODS}, {sorted(extra)} or the labels "
                         f"of --drafters (also <label>+lookup, <label>+corpus); got {sorted(unknown)}")
    corpus = None
    if args.lookup_corpus:  # read before the target loads: a wrong folder says so at once
        from angelspec_hf.policy import CorpusIndex

        try:
            corpus = CorpusIndex.from_path(args.lookup_corpus)
        except (FileNotFoundError, ValueError, KeyError) as error:
            raise SystemExit(f"--lookup-corpus {args.lookup_corpus}: {error}") from None
    target, tokenizer = angelspec_hf.load_target(args.target, device=args.device, dtype=args.dtype)
    drafters, untrained = {}, []
    needed = {drafter_of(m) for m in methods if drafter_of(m) in DRAFTER_OF.values()}
    needed |= {"mtp", "dfly"} if "router" in methods else set()
    for label in sorted({drafter_of(m) for m in methods} & set(given) - set(METHODS)):  # extra drafters, own methods
        drafters[label] = drafter_for_target(given[label], target)
    for family in sorted(needed - {"router"}):
        if family in given:
            drafters[family] = drafter_for_target(given[family], target)
        else:  # the shipped drafter for the embedded target, else a fresh untrained one (said in the output)
            torch.manual_seed(0)
            drafters[family], trained = shipped_or_untrained(family, target)
            if not trained:
                untrained.append(family)
    if "router" in methods:
        from angelspec_hf.router import DrafterRouter

        drafters["router"] = DrafterRouter({"mtp": drafters["mtp"], "dfly": drafters["dfly"]}, tokenizer)
    try:
        set_stop_threshold(drafters, args.draft_stop_threshold)
    except ValueError as error:
        raise SystemExit(str(error)) from None
    kernels = args.kernels_line = use_linear_kernels(args.linear_kernels, target, *drafters.values())
    prompt_sets = load_prompt_sets(args.sets.split(","), args.prompts_per_set, args.prompts)
    if args.concurrency:
        from angelspec_hf.bench_batch import concurrency_main

        return concurrency_main(args, target, tokenizer, drafters, untrained, prompt_sets)
    temperatures = [float(t) for t in args.temperatures.split(",")]
    setting = (f"target {args.target or angelspec_hf.targets.DEFAULT_TARGET}; {args.max_new_tokens} new tokens; "
               f"{args.prompts_per_set} prompts per set; temperatures {temperatures}; "
               + ", ".join(f"{f}: {'UNTRAINED' if f in untrained else given.get(f, 'shipped')} (draft {d.num_draft_tokens}"
                           f", `_full` cut at {getattr(d.config, 'draft_stop_threshold', 0.0) or 0.0:g})"
                           for f, d in drafters.items() if f != "router")
               + f"; {describe_device(target.device)}, {str(target.dtype).removeprefix('torch.')}, {args.threads} CPU "
               f"threads; linear kernels: {kernels}")
    corpora = None if corpus is None else dict.fromkeys(drafters, corpus)  # None: each drafter's own
    records = run_bench(target, tokenizer, drafters, methods, prompt_sets, temperatures, args.max_new_tokens,
                        corpora=corpora)
    rows = summarise(records)
    paths = write_outputs(records, rows, args.out, {"setting": setting, "untrained": untrained})
    print(Path(paths["markdown"]).read_text())
    print("wrote " + ", ".join(str(p) for p in paths.values()))
    mismatches = [r for r in rows if r["divergent"] and r["method"] != "ar_stock"]
    for r in rows:
        if r["identical"] is False and r["method"] == "ar_stock":  # other kernels, other sums: not speculation
            print(f"note: plain generate with the stock kernels differs from the prepacked target on {r['set']}")
        elif r["ties"] and r["method"] != "ar_stock" and r["set"] != "all":
            print(f"note: {r['method']} parted from AR at a precision tie on {r['ties']} {r['set']} prompt(s) "
                  f"({str(target.dtype).removeprefix('torch.')}: see angelspec_hf/identity.py)")
    for r in mismatches:
        print(f"FAILURE: {r['method']} greedy output differs from AR on {r['set']}")
    return 1 if mismatches else 0


def add_bench_parser(sub) -> None:
    bench = sub.add_parser("bench", help="methods side by side: τ, tokens/s, speed-up",
                           description="Speculative methods side by side on the same prompts, interleaved in one run: "
                           "τ, tokens/s, speed-up over plain generate and greedy identity, as a table, JSON and plots.")
    bench.add_argument("--target", default=None, help="HF id or folder (default: the embedded SmolLM2-135M-Instruct)")
    bench.add_argument("--methods", default=",".join(METHODS),
                       help=f"comma list of {METHODS}; also dfly_full+lookup (mtp_, dflash_): whole blocks with "
                            "lookups; mtp+corpus, dflash+corpus")
    bench.add_argument("--lookup-corpus", default=None,
                       help="a lookup corpus for every drafter's +corpus method to look up in: a "
                            "lookup_corpus.safetensors, a drafter folder holding one, or a folder of regenerated "
                            "replies (`angelspec regenerate`'s output) (default: each drafter's own, from its folder)")
    bench.add_argument("--drafters", default="",
                       help="family=folder/id pairs, e.g. dfly=runs/dfly,mtp=runs/mtp; any other label=folder adds "
                            "a method of that name (name it in --methods), e.g. dfly8k=my-dfly-8k")
    bench.add_argument("--sets", default=",".join(EVAL_SETS))
    bench.add_argument("--prompts", default=None, help="your own jsonl with a 'prompt' field (replaces --sets)")
    bench.add_argument("--prompts-per-set", type=int, default=4)
    bench.add_argument("--temperatures", default="0,1")
    bench.add_argument("--max-new-tokens", type=int, default=128)
    bench.add_argument("--threads", type=int, default=2)
    add_device_arguments(bench)
    add_linear_kernels_argument(bench)
    bench.add_argument("--out", default="outputs/bench")
    bench.add_argument("--concurrency", default=None,
                       help="e.g. 1,2,4,8,16,32: the batched engine under closed-loop load (plain, fixed depth, D-Cut)")
    bench.add_argument("--requests-per-client", type=int, default=2, help="with --concurrency")
    bench.add_argument("--repeats", type=int, default=1,
                       help="with --concurrency: run every method this many times, interleaved; report medians")
    bench.add_argument("--fixed-depths", default="1,3,7", help="with --concurrency: DFly's fixed-depth baselines")
    bench.add_argument("--draft-stop-threshold", type=float, default=None,
                       help="the `_full` methods: end a draft once the product of the drafter's probabilities falls "
                            "below this, for every drafter (0: whole blocks, to compare drafters alike; default: "
                            "each drafter's own `draft_stop_threshold`, e.g. 0.4 for the shipped DFly)")
    bench.set_defaults(func=bench_main)
