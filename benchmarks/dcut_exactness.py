"""Is sampling through the batched engine exact under every verify mode? The exactness experiment, through the public
API (`angelspec_hf.generate_batch`).

The target is a tiny Llama whose next-token distribution is p = (0.5, 0.5) after every context (its final norm zeroes
the one hidden unit the 2-token LM head reads), so every emitted token must be an independent fair coin whatever the
drafter does. The drafter (same LM head, its own hidden states) mostly favours token 0, with a confidence that varies
from context to context, so q is far from p. A sampler that lets the drawn draft token influence whether it is verified (the rule before the fix:
D-Cut ranks positions by q of the drawn token) comes out visibly biased; the fixed engine must not.

    python benchmarks/dcut_exactness.py --tokens 60000
"""

from __future__ import annotations

import argparse
import time

import torch
from scipy.stats import binomtest
from transformers import LlamaConfig, LlamaForCausalLM

from angelspec_hf import DFlyDrafter, generate_batch
from angelspec_hf.policy import CostModel
from angelspec_hf.tgi_patch.engine import SpeculativeEngine


def fair_coin_target() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=2, hidden_size=32, intermediate_size=37, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, max_position_embeddings=512, bos_token_id=None, eos_token_id=None,
                         pad_token_id=None)
    target = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        target.lm_head.weight.zero_()
        target.lm_head.weight[0, 0], target.lm_head.weight[1, 0] = 1.0, -1.0  # logit gap = 2 * hidden[0]
        target.model.norm.weight[0] = 0.0  # ... which the target's final norm zeroes: p = (0.5, 0.5) always
        target.model.embed_tokens.weight[:, 0] = 4.0  # drafters start from these embeddings: they will favour token 0
    return target


def confident_drafter(target) -> DFlyDrafter:
    torch.manual_seed(1)
    drafter = DFlyDrafter.from_target(target, block_size=5, mask_token_id=0, draft_length="full").eval()
    with torch.no_grad():
        drafter.norm.weight[0] = 0.2  # q far from p (mostly favouring token 0), different from one context to the next
    return drafter


class OldRuleEngine(SpeculativeEngine):
    """The engine before the fix: D-Cut ranks a sampled position by q of the token actually drawn there."""

    def draft_confidence(self, probs, token):
        return probs.gather(1, token[:, None]).squeeze(1)

    def plan_acceptance(self, accept, sampled):
        return accept


def run(target, drafter, verify, temperature, requests, engine_cls=SpeculativeEngine):
    """`requests` requests of 3 new tokens: the first from the prefill, the second at the one drafted position (the
    draft accepted, or the correction drawn), the third the next plain/bonus token. The second is the one tested."""
    cost = CostModel((1.0, 0.0, 0.03), (0.1, 0.0))  # verification is marginal: D-Cut's choices depend on confidence
    engine = engine_cls(target, drafter, verify=verify, max_batch_size=64, cost_model=cost)
    prompts = torch.randint(0, 2, (requests, 6), generator=torch.Generator().manual_seed(2)).tolist()  # varied q
    outputs, engine = generate_batch(target, drafter, prompts, max_new_tokens=3, do_sample=True,
                                     temperature=temperature, seed=1000, engine=engine, return_engine=True)
    emitted = [out[1] for out in outputs]
    zeros = sum(t == 0 for t in emitted)
    stats = engine.stats
    return zeros / len(emitted), binomtest(zeros, len(emitted), 0.5).pvalue, len(emitted), stats


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=60000, help="requests (= tested tokens) per row")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--verify", default="full,auto,16,depth:1")
    parser.add_argument("--temperatures", default="1,0.7")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    target = fair_coin_target()
    drafter = confident_drafter(target)
    print(f"fair-coin target (p = 0.5, 0.5 at every position), DFly drafter (block 5), {args.tokens} tokens per row")
    print("| engine | verify | T | P(token 0) | binomial p-value | drafted verified / accepted | seconds |")
    print("|---|---|---|---|---|---|---|")
    worst = 1.0
    for engine_cls in (SpeculativeEngine, OldRuleEngine):
        for verify in args.verify.split(","):
            verify = int(verify) if verify.isdigit() else verify
            for temperature in (float(t) for t in args.temperatures.split(",")):
                start = time.perf_counter()
                rate, pvalue, n, stats = run(target, drafter, verify, temperature, args.tokens, engine_cls)
                name = "fixed" if engine_cls is SpeculativeEngine else "old rule"
                if engine_cls is SpeculativeEngine:
                    worst = min(worst, pvalue)
                print(f"| {name} | {verify} | {temperature:g} | {rate:.4f} | {pvalue:.2g} | "
                      f"{stats['verified']} / {stats['accepted']} | {time.perf_counter() - start:.0f} |", flush=True)
    print(f"smallest p-value of the fixed engine: {worst:.3g} ({'no' if worst > 1e-3 else 'a'} significant deviation "
          f"at 1e-3)")
    return 0 if worst > 1e-3 else 1


if __name__ == "__main__":
    raise SystemExit(main())
