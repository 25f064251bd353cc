"""DrafterRouter: domain cues, prior then measured choice, and lossless generate() through whichever drafter."""

import torch

from angelspec_hf.router import DrafterRouter, classify_domain
from helpers import tiny_chat_target, tiny_drafter


def test_classify_domain():
    assert classify_domain("Write a Python function that reverses a list.") == "code"
    assert classify_domain("```js\nconst x = 1;\n```  fix this") == "code"
    assert classify_domain("Tom has 3 apples and buys 5 more. How many apples does he have?") == "math"
    assert classify_domain("Tell me about the history of Rome.") == "chat"


def test_router_prior_then_measured_choice_and_lossless_output():
    target, tokenizer = tiny_chat_target()
    drafters = {"mtp": tiny_drafter("mtp", target), "dfly": tiny_drafter("dfly", target)}
    router = DrafterRouter(drafters, tokenizer, min_observations=2)
    prompts = ["Write a Python function to add two numbers.", "Tell me a story about a cat.",
               "Implement bubble sort in Java.", "Describe the sea."] * 3
    for prompt in prompts:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                            return_tensors="pt", return_dict=True)["input_ids"]
        kw = dict(max_new_tokens=10, do_sample=False)
        assert torch.equal(target.generate(ids, **kw), target.generate(ids, assistant_model=router, **kw))
        assert router.last_speculation_stats is drafters[router.choices[-1][1]].last_speculation_stats
    router.finish()
    assert [c for c in router.choices[:2]] == [("code", "dfly"), ("chat", "mtp")]  # the domain prior first
    assert router.estimate("code", "dfly") is not None and router.estimate("chat", "mtp") is not None
    # exploration tried the other drafter on some domain, so both get measured where it matters
    assert {name for _, name in router.choices} == {"mtp", "dfly"}
    assert len(router.choices) == len(prompts)
