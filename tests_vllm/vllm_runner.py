"""Run vLLM once on token-id prompts and write what it produced as JSON: the greedy token ids per prompt and vLLM's own
speculative-decoding counters. A script, so that each vLLM engine (and its engine-core process) lives and dies in a
process of its own; the tests in this folder call it with the vLLM venv's python.

    .venv-vllm/bin/python tests_vllm/vllm_runner.py --model TARGET_FOLDER --prompts prompts.json --out out.json \
        [--method eagle3|dflash --draft DRAFT_FOLDER --num-speculative-tokens K] [--max-tokens 32]

prompts.json: a list of token-id lists (already chat-templated). out.json: {"outputs": [[ids], ...], "spec": {"drafts",
"draft_tokens", "accepted", "accepted_per_position"}} (the `vllm:spec_decode_*` metrics; zeros for plain decoding).
"""

from __future__ import annotations

import argparse
import json
import os

SPEC_METRICS = {"vllm:spec_decode_num_drafts": "drafts", "vllm:spec_decode_num_draft_tokens": "draft_tokens",
                "vllm:spec_decode_num_accepted_tokens": "accepted"}


def spec_counters(llm) -> dict:
    """vLLM's speculative-decoding counters since the engine started, read from `LLM.get_metrics()`."""
    out = {"drafts": 0, "draft_tokens": 0, "accepted": 0, "accepted_per_position": []}
    for metric in llm.get_metrics():
        if metric.name in SPEC_METRICS:
            out[SPEC_METRICS[metric.name]] += int(metric.value)
        elif metric.name == "vllm:spec_decode_num_accepted_tokens_per_pos":
            out["accepted_per_position"] = [int(v) for v in metric.values]
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="the target's HF folder")
    parser.add_argument("--prompts", required=True, help="JSON file: a list of token-id lists")
    parser.add_argument("--out", required=True)
    parser.add_argument("--method", default=None, help="speculative method (eagle3, dflash); none: plain decoding")
    parser.add_argument("--draft", default=None, help="the exported drafter's folder")
    parser.add_argument("--num-speculative-tokens", type=int, default=None)
    parser.add_argument("--max-tokens", type=int, default=32)
    args = parser.parse_args(argv)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; a 135M model with a few short prompts needs little

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    spec = None
    if args.method:
        spec = {"method": args.method, "model": args.draft, "num_speculative_tokens": args.num_speculative_tokens}
    # enforce_eager: no torch.compile warm-up (minutes on 2 cores); the tests check outputs, not speed
    llm = LLM(model=args.model, dtype="float32", max_model_len=2048, seed=0, enforce_eager=True,
              speculative_config=spec, disable_log_stats=False)
    prompts = [TokensPrompt(prompt_token_ids=ids) for ids in json.loads(open(args.prompts).read())]
    results = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=False))
    out = {"outputs": [list(r.outputs[0].token_ids) for r in results], "spec": spec_counters(llm)}
    with open(args.out, "w") as f:
        json.dump(out, f)


if __name__ == "__main__":  # vLLM starts its engine core in a child process that re-imports this module
    main()
