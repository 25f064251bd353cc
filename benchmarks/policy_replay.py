"""Replay the `generate()` hook's draft-length policy on recorded drafts: which rounds it would make, and what they
would cost, without timing anything.

At greedy decoding the output is the target's own, whatever the policy does, and so is the drafter's proposal after
every prefix of it (its context is the target's features of that prefix). `--record` runs plain greedy `generate` on
held-out TRAIN prompts (never regenerated, never EVAL), then drafts a whole block after every generated prefix and
looks up its n-gram continuation (and, for a drafter with a `lookup_corpus`, the corpus's continuation), keeping the
drafter's confidence at each position and how many tokens the target would accept, and measures a cost table
(`measure_costs`: target forwards over 1 .. 11 new tokens and drafts of 1 .. K tokens, interleaved). `--replay` walks
each output as the hook does (`modeling/candidate_generator.py`: a lookup when the policy verifies one, else a drafted
round or a plain step, a shadow probe where due) under each variant: `default` (a real `DraftLengthPolicy` learning
from the table's costs, each observation times log-normal noise), `corpus` (the same, with the corpus lookups beside
the n-gram ones), `whole_lookups` (the same, but a lookup matched on 2+ tokens verified whole, others not at all),
`full` (`WholeBlocks`: `draft_length="full"`), `both` (block and lookup verified in one forward) and `oracle` (each
round's best choice, knowing what the target will accept). Each round is charged its table cost, `--overhead` per
target forward and `--round-overhead` more per verifying round (calibrate both against a timed run of whole blocks,
whose rounds the replay reproduces exactly: `tests/test_policy_replay.py`). Policies are so compared on the same
rounds' outcomes, free of the timing noise of a shared machine; the speed-ups are the model's.

    python benchmarks/policy_replay.py --record replay.pt [--prompts 10] [--sets gsm8k,gpteacher_codegen,sharegpt]
    python benchmarks/policy_replay.py --replay replay.pt [--overhead 0.007] [--round-overhead 0.004] [--seeds 3] \
        [--noise 0.05] [--profile-noise 0] [--drift 0] [--variants default,corpus,whole_lookups,full,both,oracle]
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import time
from pathlib import Path

import torch

import angelspec_hf
from angelspec_hf.cpu_kernels import add_linear_kernels_argument, use_linear_kernels
from angelspec_hf.policy import NgramIndex, RoundCosts
from angelspec_hf.prompts import chat_input_ids
from angelspec_hf.shipped import trained_drafter
from angelspec_hf.trainer.evaluation import held_out_prompts
from angelspec_hf.modeling.draft_policy import DraftLengthPolicy
from angelspec_hf.modeling.drafter_utils import greedy_select

REGENERATED = Path(__file__).resolve().parent.parent / "data" / "regenerated"


# ---- recording ------------------------------------------------------------------------------------------------------
def matched(proposal: list[int], reference: list[int]) -> int:
    """How many leading tokens of `proposal` equal `reference`'s."""
    n = 0
    for a, b in zip(proposal, reference):
        if a != b:
            break
        n += 1
    return n


@torch.no_grad()
def record_prompt(target, drafter, input_ids, max_new_tokens: int) -> dict:
    """Plain greedy output of one prompt, and after each generated prefix: the drafter's whole block (its confidence
    per position, tokens accepted) and the n-gram lookup's continuation (matched n, tokens offered, accepted)."""
    out = target.generate(input_ids, max_new_tokens=max_new_tokens, do_sample=False)
    ids = out[0].tolist()
    prompt = input_ids.shape[1]
    layers = [i + 1 for i in drafter.config.target_layer_ids]
    hidden = target(input_ids=out, output_hidden_states=layers).hidden_states
    features = torch.cat([hidden[i] for i in layers], -1).to(drafter.device, drafter.dtype)
    embed, head = target.get_input_embeddings(), drafter.draft_lm_head(target.get_output_embeddings())
    lookup_tokens = int(getattr(drafter.config, "lookup_tokens", 0) or 0)
    index = NgramIndex(int(getattr(drafter.config, "lookup_max_ngram", 3) or 3))
    corpus = getattr(drafter, "lookup_corpus", None) if lookup_tokens else None
    state, blocks, lookups, found = drafter.new_draft_state(), [], [], []
    for anchor in range(prompt, len(ids) - 1):  # the first generated token comes from the prefill
        peaks = []

        def select(logits, j):
            token, q, peak = greedy_select(logits, j)
            peaks.append(float(peak[0]))
            return token, q, peak

        context = features[:, state.context_length:anchor]
        draft, _ = drafter.propose(state, context, out[:, : anchor + 1].to(drafter.device), drafter.num_draft_tokens,
                                   embed, head, select)
        reference = ids[anchor + 1:]
        blocks.append((peaks, matched(draft[0].tolist(), reference)))
        index.extend_to(ids[: anchor + 1])
        tokens, n = index.continuation(lookup_tokens) if lookup_tokens else ([], 0)
        lookups.append((n, len(tokens), matched(tokens, reference)))
        if corpus is not None:
            tokens, confidences = corpus.continuation(ids[: anchor + 1], lookup_tokens)
            found.append((len(tokens), confidences, matched(tokens, reference)))
    return {"prompt_length": prompt, "generated": len(ids) - prompt, "ids": ids, "blocks": blocks, "lookups": lookups,
            "corpus": found if corpus is not None else None, "max_tokens": drafter.num_draft_tokens}


@torch.no_grad()
def measure_costs(target, drafter, context: int = 160, new: int = 3, repeats: int = 7) -> dict:
    """Median seconds of a target forward over n = 1 .. max(K, lookup_tokens) + 1 new tokens after `context` tokens,
    and of the drafter proposing k = 1 .. K tokens after ingesting `new` tokens' features (a round after one that
    accepted `new - 1`), as the hook drafts (its confidences read on the host); sizes interleaved, so a slow stretch
    of the machine is spread over all of them."""
    from transformers import DynamicCache

    longest = max(drafter.num_draft_tokens, int(getattr(drafter.config, "lookup_tokens", 0) or 0)) + 1
    layers = [i + 1 for i in drafter.config.target_layer_ids]
    size = context + max(longest, new)
    ids = torch.randint(3, target.config.vocab_size, (1, size), generator=torch.Generator().manual_seed(0))
    out = target(input_ids=ids, output_hidden_states=layers)
    features = torch.cat([out.hidden_states[i] for i in layers], -1).to(drafter.device, drafter.dtype)
    cache = DynamicCache(config=target.config)
    target(input_ids=ids[:, :context], cache=cache, use_cache=True)
    embed, head = target.get_input_embeddings(), drafter.draft_lm_head(target.get_output_embeddings())

    def select(logits, j):
        token, q, peak = greedy_select(logits, j)
        float(peak[0])  # the hook reads each confidence on the host
        return token, q, peak

    steps = {n: [] for n in range(1, longest + 1)}
    drafts = {k: [] for k in range(1, drafter.num_draft_tokens + 1)}
    for repeat in range(repeats + 1):  # the first pass warms up
        for n in steps:
            start = time.perf_counter()
            target(input_ids=ids[:, context: context + n], cache=cache, use_cache=True, output_hidden_states=layers)
            seconds = time.perf_counter() - start
            cache.crop(-n)
            if repeat:
                steps[n].append(seconds)
        for k in drafts:
            state = drafter.new_draft_state()
            drafter.propose(state, features[:, :context], ids[:, : context + 1], 1, embed, head)
            start = time.perf_counter()
            drafter.propose(state, features[:, context: context + new], ids[:, : context + new + 1], k, embed, head,
                            select)
            if repeat:
                drafts[k].append(time.perf_counter() - start)
    return {"step": [statistics.median(steps[n]) for n in steps],
            "draft": [statistics.median(drafts[k]) for k in drafts]}


# ---- replaying ------------------------------------------------------------------------------------------------------
def profile_from(costs: dict) -> RoundCosts:
    """The `RoundCosts` a profile of these costs would give (`round_costs.profile_round_costs`'s fit)."""
    step, draft = costs["step"], costs["draft"]
    k = len(draft)
    b = max(step[k] - step[0], 0.0) / k
    c1 = max(draft[-1] - draft[0], 0.0) / max(k - 1, 1)
    return RoundCosts((step[0] - b, b), (max(draft[0] - c1, 0.0), c1), plain_step=step[0], step_table=tuple(step))


class WholeBlocks:
    """`draft_length="full"` with the hook's interface: every round drafts until the drafter's own probability of its
    block falls below `threshold` (`draft_stop_threshold`, 0.4 for the shipped DFly), and a lookup matched on 2 tokens
    or more is verified whole."""

    shadow_due = False

    def __init__(self, threshold: float = 0.4, max_ngram: int = 3):
        self.threshold, self.max_ngram = threshold, max_ngram
        self.survival, self.drafted = 1.0, 0

    def new_sequence(self, mode=None):
        pass

    def lookup_length(self, confidence, available, draft_tokens, repeating=False):
        return available if round(confidence * self.max_ngram) >= 2 else 0

    def start_round(self, max_tokens):
        self.survival, self.drafted = 1.0, 0
        return max_tokens > 0

    def keep_drafting(self, confidence, max_tokens):
        self.survival *= confidence
        self.drafted += 1
        return self.survival >= self.threshold and self.drafted < max_tokens

    def observe(self, *args, **kwargs):
        pass

    observe_lookup = observe_shadow = observe


def step_cost(step: list[float], rows: int) -> float:
    """A target forward over `rows` new tokens; past the measured sizes, the slope of the last three."""
    if rows <= len(step):
        return step[rows - 1]
    return step[-1] + (rows - len(step)) * (step[-1] - step[-4]) / 3


def hook_round(policy, block, lookup, num_tokens, available, max_ngram, repeating, corpus=None, room=0):
    """One round as `AngelSpecCandidateGenerator` makes it under `policy`: `("lookup", k)`, `("corpus", k)` (with
    `corpus`, the recorded corpus lookup at this prefix, and `room` tokens left), `("draft", k)`, `("shadow", 1)` (a
    plain step with a shadow draft beside it) or `("plain", 0)`."""
    peaks, _ = block
    n = lookup[0]
    k = policy.lookup_length(n / max_ngram, available, num_tokens, repeating=repeating) if n and available else 0
    if corpus is not None and not (k and repeating):
        confidences = corpus[1][:min(corpus[0], room)]
        corpus_k, corpus_rate = policy.lookup_plan(confidences, num_tokens, corpus=True)
        if corpus_k and (not k or corpus_rate > policy.lookup_rate([n / max_ngram] * k)):
            return "corpus", corpus_k
    if k:
        return "lookup", k
    if not policy.start_round(num_tokens):
        return ("shadow", 1) if policy.shadow_due else ("plain", 0)
    k = 1
    while policy.keep_drafting(peaks[k - 1], num_tokens):
        k += 1
    return "draft", k


def oracle_round(block, lookup, num_tokens, available, step, draft, overhead, round_overhead):
    """The round with the most tokens per second, knowing what the target will accept: a plain step, the lookup's
    accepted tokens or the block's (and nothing after them)."""
    options = [(1 / (step[0] + overhead), "plain", 0)]
    if min(lookup[2], available):
        k = min(lookup[2], available)
        options.append(((1 + k) / (step[k] + overhead + round_overhead), "lookup", k))
    if min(block[1], num_tokens):
        k = min(block[1], num_tokens)
        options.append(((1 + k) / (draft[k - 1] + step[k] + overhead + round_overhead), "draft", k))
    _, kind, k = max(options)
    return kind, k


def replay(trace: dict, policy, costs: dict, overhead: float = 0.0, noise: float = 0.0, rng=None,
           max_ngram: int = 3, threshold: float = 0.4, round_overhead: float = 0.0, drift: dict | None = None,
           use_corpus: bool = False) -> dict:
    """Walk one recorded output round by round. `policy`: an object with the hook's interface (`DraftLengthPolicy`,
    `WholeBlocks`; updated as it goes, its timings the costs times log-normal `noise`), `"oracle"` (`oracle_round`)
    or `"both"` (every round verifies the block, cut at `threshold` as `WholeBlocks` cuts it, and beside it, in the
    same forward, the lookup when one matched on 2+ tokens: a tree of two branches, the longer accepted one kept).
    `use_corpus`: the hook's policy also weighs the corpus lookup recorded at each prefix (`trace["corpus"]`).
    `drift`: `{"sigma", "rounds", "log"}`, the machine's speed wandering from round to round (its log an AR(1) process
    of standard deviation `sigma` and correlation length `rounds`, now at `log`, carried from call to call): what the
    policy observes is slowed by it, what the round is charged is not, so only the decisions it moves count.
    Every forward costs `overhead` beside the measured one (generate's own work), a round that verifies tokens
    `round_overhead` more (the assisted loop's and the hook's). Returns the seconds it would take, those of plain
    decoding, and each round as `(kind, verified, accepted)`."""
    step, draft = costs["step"], costs["draft"]
    rng = rng or random.Random(0)
    speed = drift or {"sigma": 0.0, "rounds": 1.0, "log": 0.0}
    keep = math.exp(-1.0 / speed["rounds"])

    def timed(seconds):
        return seconds * math.exp(speed["log"] + (rng.gauss(0.0, noise) if noise else 0.0))

    hook = not isinstance(policy, str)
    if hook:
        policy.new_sequence()
    total, done, seconds, rounds, repeating = trace["generated"], 1, 0.0, [], False
    while done < total:  # `done` tokens generated (the first by the prefill); records are per prefix
        block, lookup = trace["blocks"][done - 1], trace["lookups"][done - 1]
        num_tokens = max(0, min(trace["max_tokens"], total - done - 1))
        available = min(lookup[1], total - done - 1)
        if policy == "oracle":
            kind, k = oracle_round(block, lookup, num_tokens, available, step, draft, overhead, round_overhead)
        elif policy == "both":
            survival, k = 1.0, 0
            while k < num_tokens and (k == 0 or survival >= threshold):
                survival *= block[0][k]
                k += 1
            lookup_k = available if lookup[0] >= 2 else 0
            accepted = max(min(k, block[1]), min(lookup_k, lookup[2]))
            seconds += (draft[k - 1] if k else 0.0) + step_cost(step, 1 + k + lookup_k) + overhead + round_overhead
            rounds.append(("both", k + lookup_k, accepted))
            done += 1 + accepted
            continue
        else:
            corpus = trace["corpus"][done - 1] if use_corpus else None
            kind, k = hook_round(policy, block, lookup, num_tokens, available, max_ngram, repeating, corpus,
                                 total - done - 1)
        if kind == "corpus":
            accepted, t = min(k, corpus[2]), step[k] + overhead + round_overhead
            policy.observe_lookup(corpus[1][:k], k, accepted, timed(step[k]), corpus=True)
        elif kind == "lookup":
            accepted, t = min(k, lookup[2]), step[k] + overhead + round_overhead
            if hook:
                policy.observe_lookup(lookup[0] / max_ngram, k, accepted, timed(step[k]))
        elif kind == "draft":
            accepted, t = min(k, block[1]), draft[k - 1] + step[k] + overhead + round_overhead
            if hook:
                policy.observe(k, accepted, timed(draft[k - 1]), timed(step[k]), timed(t))
        else:
            accepted, t = 0, step[0] + overhead + (draft[0] if kind == "shadow" else 0.0)
            if kind == "shadow":
                policy.observe_shadow(block[0][0], float(block[1] >= 1), timed(draft[0]))
                policy.observe(0, 0, None, timed(step[0]))
            elif hook:
                policy.observe(0, 0, None, timed(step[0]), timed(t))
        repeating = kind == "lookup" and accepted >= k
        if speed["sigma"]:
            speed["log"] = keep * speed["log"] + rng.gauss(0.0, speed["sigma"] * math.sqrt(1 - keep * keep))
        rounds.append((kind, k, accepted))
        seconds += t
        done += 1 + accepted
    return {"seconds": seconds, "plain_seconds": (total - 1) * (step[0] + overhead), "rounds": rounds}


def summary(results: list[dict]) -> dict:
    """Forwards, rounds of each kind, tokens verified and accepted per kind, over `replay` results."""
    out = {"forwards": 0}
    for result in results:
        for kind, verified, accepted in result["rounds"]:
            out["forwards"] += 1
            for key, value in ((kind, 1), (f"{kind} verified", verified), (f"{kind} accepted", accepted)):
                out[key] = out.get(key, 0) + value
    return out


def replay_all(traces, costs, variant, overhead, noise, seed, max_tokens, profile_noise=0.0,
               round_overhead=0.0, drift: tuple[float, float] = (0.0, 1.0)) -> list[dict]:
    """Every trace in turn under one policy (it carries over from call to call, as on a drafter). The cost-aware
    policy's profile is the costs, each step size's times log-normal noise of sigma `profile_noise` (a profile taken
    on a busy machine)."""
    rng = random.Random(seed)
    if variant in ("oracle", "both"):
        policy = variant
    elif variant == "full":
        policy = WholeBlocks()
    else:
        profiled = dict(costs, step=[t * rng.lognormvariate(0.0, profile_noise) for t in costs["step"]])
        policy = DraftLengthPolicy(profile_from(profiled), max_tokens)
        if variant == "whole_lookups":  # lookups as `_full` takes them, the rest as the cost-aware policy does
            policy.lookup_length = WholeBlocks().lookup_length
    speed = {"sigma": drift[0], "rounds": drift[1], "log": 0.0}
    use_corpus = variant == "corpus"
    if use_corpus and any(t["corpus"] is None for t in traces):
        raise ValueError("the corpus variant needs traces recorded with a drafter that has a lookup_corpus")
    return [replay(t, policy, costs, overhead, noise, rng, round_overhead=round_overhead, drift=speed,
                   use_corpus=use_corpus) for t in traces]


VARIANTS = ("default", "corpus", "whole_lookups", "full", "both", "oracle")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--record", help="record traces and costs into this file")
    parser.add_argument("--replay", help="replay the traces and costs of this file")
    parser.add_argument("--prompts", type=int, default=10, help="held-out TRAIN prompts per set")
    parser.add_argument("--sets", default="gsm8k,gpteacher_codegen,sharegpt")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--overhead", type=float, default=0.007,
                        help="seconds per target forward besides the measured forward (generate's own work)")
    parser.add_argument("--round-overhead", type=float, default=0.0,
                        help="seconds more per round that verifies tokens (the assisted loop's and the hook's work)")
    parser.add_argument("--noise", type=float, default=0.05, help="log-normal sigma of each time the policy observes")
    parser.add_argument("--drift", type=float, default=0.0,
                        help="standard deviation of the log of the machine's wandering speed, as the policy sees it")
    parser.add_argument("--drift-rounds", type=float, default=50.0, help="its correlation length in rounds")
    parser.add_argument("--profile-noise", type=float, default=0.0,
                        help="log-normal sigma of each step size's profiled time (the policy's starting costs)")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"of {VARIANTS}")
    add_linear_kernels_argument(parser)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.record:
        target, tokenizer = angelspec_hf.load_default_target()
        drafter = trained_drafter("dfly", target)
        print(use_linear_kernels(args.linear_kernels, target, drafter))
        traces = []
        for name in args.sets.split(","):
            for prompt in held_out_prompts((name,), args.prompts, REGENERATED):
                trace = record_prompt(target, drafter, chat_input_ids(tokenizer, prompt), args.max_new_tokens)
                traces.append(trace | {"set": name})
                print(name, trace["generated"], "tokens", flush=True)
        costs = measure_costs(target, drafter)
        print("step ms", [round(1e3 * s, 1) for s in costs["step"]], "draft ms",
              [round(1e3 * s, 1) for s in costs["draft"]])
        torch.save({"traces": traces, "costs": costs, "max_tokens": drafter.num_draft_tokens}, args.record)
    if args.replay:
        data = torch.load(args.replay)
        traces, costs = data["traces"], data["costs"]
        sets = sorted({t["set"] for t in traces})
        print(f"{len(traces)} outputs; step ms", [round(1e3 * s, 1) for s in costs["step"]], "draft ms",
              [round(1e3 * s, 1) for s in costs["draft"]], f"overhead {1e3 * args.overhead:.1f} ms (+{1e3 * args.round_overhead:.1f} a verifying round)")
        for name in args.variants.split(","):
            # the others do not learn from timings
            seeds = args.seeds if name in ("default", "corpus", "whole_lookups") else 1
            speed = {s: [] for s in sets + ["all"]}
            counts = []
            for seed in range(seeds):
                results = replay_all(traces, costs, name, args.overhead, args.noise, seed, data["max_tokens"],
                                     args.profile_noise, args.round_overhead, (args.drift, args.drift_rounds))
                for s in speed:
                    rows = [r for r, t in zip(results, traces) if s in ("all", t["set"])]
                    speed[s].append(sum(r["plain_seconds"] for r in rows) / sum(r["seconds"] for r in rows))
                counts.append(summary(results))
            mean_counts = {k: round(statistics.mean(c.get(k, 0) for c in counts)) for k in counts[0]}
            print(f"{name:>8}", " ".join(f"{s} {statistics.mean(v):.3f}x" for s, v in speed.items()), mean_counts)


if __name__ == "__main__":
    main()
