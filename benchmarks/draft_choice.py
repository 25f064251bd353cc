"""What choosing one draft token costs: the `generate()` hook's `_select` and the batched engine's greedy selector,
on the draft vocabulary's rows (the shipped code) and over the whole vocabulary (the same code with the pruned
head's ids withheld), plus `torch.multinomial` against the hook's inverse-CDF `draw_token`.

    python benchmarks/draft_choice.py --threads 2

Logits come from the shipped DFly's pruned head on the embedded target (49,152 tokens, 8,192 drafted), so the -inf
pattern is the real one; each timing is the median over `--repeats` rounds of `--calls` calls, the variants interleaved
round by round. Prints microseconds per call (per drafted position; the engine's for a whole batch of rows).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from transformers import GenerationConfig, LogitsProcessorList, TopKLogitsWarper

import angelspec_hf
from angelspec_hf.modeling import candidate_generator
from angelspec_hf.policy import draft_confidence
from angelspec_hf.shipped import trained_drafter
from angelspec_hf.tgi_patch.engine import SamplingParams, verification
from angelspec_hf.tgi_patch.engine.request import Request


def timed(variants: dict, calls: int, repeats: int) -> dict[str, float]:
    """Median µs per call of each zero-argument callable, the variants interleaved round by round."""
    times = {name: [] for name in variants}
    for fn in variants.values():
        for _ in range(max(1, calls // 10)):
            fn()
    for _ in range(repeats):
        for name, fn in variants.items():
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            times[name].append(1e6 * (time.perf_counter() - start) / calls)
    return {name: statistics.median(t) for name, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    target, tokenizer = angelspec_hf.load_default_target()
    drafter = trained_drafter("dfly", target)
    prompt = tokenizer("def reverse(xs):", return_tensors="pt")["input_ids"]
    head = drafter.draft_lm_head(target.get_output_embeddings())
    with torch.no_grad():
        hidden = target.model.norm(torch.randn(33, target.config.hidden_size))
        logits = head(hidden)  # [33, V]: -inf outside the draft vocabulary

    def hook(do_sample: bool, processors: list, rows: bool):
        generator = drafter.get_candidate_generator(
            target, prompt, GenerationConfig(do_sample=do_sample, max_length=64), LogitsProcessorList(processors))
        if not rows:
            generator._draft_ids = None  # the full-vocabulary path of the same method
        row = logits[:1]

        def call():
            generator._prefix, generator._round_probs = prompt, []
            generator._select(row, 0)
        return call

    cases = {
        "hook, greedy: draft rows": hook(False, [], True),
        "hook, greedy: full vocabulary": hook(False, [], False),
        "hook, sampling with top-k 50: draft rows": hook(True, [TopKLogitsWarper(50)], True),
        "hook, sampling with top-k 50: full vocabulary": hook(True, [TopKLogitsWarper(50)], False),
    }
    probs = torch.softmax(logits[:1], -1)
    cases["one draw over 49k: torch.multinomial"] = lambda: torch.multinomial(probs, 1)
    cases["one draw over 49k: draw_token (inverse CDF)"] = lambda: candidate_generator.draw_token(probs)
    for batch in (1, 8, 32):
        requests = [Request(i, [1, 2], SamplingParams(max_new_tokens=8), 1000 + i, frozenset()) for i in range(batch)]
        for name, ids in (("draft columns", head.ids), ("full vocabulary", None)):
            select = verification.draft_selector(requests, logits.device, verification.process_requests,
                                                 draft_confidence, ids)
            cases[f"engine, all greedy, batch {batch}: {name}"] = (lambda s=select, b=batch: s(logits[:b], 0))
    with torch.inference_mode():
        results = timed(cases, args.calls, args.repeats)
    print(f"{args.threads} threads, torch {torch.__version__}; µs per drafted position (median of {args.repeats})")
    for name, us in results.items():
        print(f"  {name:52s} {us:9.1f}")


if __name__ == "__main__":
    main()
