"""The README's Python quick start runs as written: its "Generate" and "Generate in batches" blocks, taken verbatim from
README.md and executed in order on the embedded target with the shipped drafter, produce the target's own greedy
tokens (with and without the drafter, alone and in a batch)."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

import pytest
import torch

README = Path(__file__).resolve().parent.parent / "README.md"


def python_block_after(heading: str) -> str:
    """The first ```python block under the README heading `heading` (a `### ...` line)."""
    text = README.read_text(encoding="utf-8")
    start = text.index(f"\n{heading}\n")
    match = re.compile(r"```python\n(.*?)```", re.DOTALL).search(text, start)
    assert match, f"no python block under {heading!r}"
    return match.group(1)


@pytest.mark.real_model
def test_the_readme_quick_start_runs_as_written_and_is_lossless():
    namespace: dict = {}
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(python_block_after("### Generate"), "README.md:Generate", "exec"), namespace)
        exec(compile(python_block_after("### Generate in batches"), "README.md:Generate in batches", "exec"), namespace)
    target, tokenizer, inputs, out = (namespace[k] for k in ("target", "tokenizer", "inputs", "out"))
    assert namespace["drafter"] is not None, "the shipped DFly was not found (run `angelspec install-drafters`)"

    plain = target.generate(**inputs, do_sample=False, max_new_tokens=128)
    assert torch.equal(out, plain), "the README's speculative generate differs from plain generate"
    assert printed.getvalue().count("\n") >= 3  # the text, τ and the batch's texts were printed

    for prompt, ids in zip(["Write a haiku.", "What is 12 * 13?"], namespace["outputs"], strict=True):
        chat = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                             return_tensors="pt", return_dict=True)
        reference = target.generate(**chat, do_sample=False, max_new_tokens=64)[0, chat["input_ids"].shape[1]:]
        assert list(ids) == reference.tolist()[: len(ids)] and len(ids) > 0
