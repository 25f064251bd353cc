"""The Gradio Space (`spaces_demo/app.py`) served on 127.0.0.1 and driven through `gradio_client`, on the embedded
target: the speculative text it returns is the target's own greedy text, its statistics add up, bad input gets a
clear error, and the batch tab's engine gives the same tokens under fixed depth and D-Cut."""

import os
import socket

os.environ["GRADIO_ANALYTICS_ENABLED"] = "False"

import pytest  # noqa: E402
from gradio_client import Client  # noqa: E402
from gradio_client.exceptions import AppError  # noqa: E402

import angelspec_hf  # noqa: E402
from angelspec_hf.prompts import chat_input_ids  # noqa: E402
from angelspec_hf import DFlyDrafter, MTPDrafter  # noqa: E402
from angelspec_hf.spaces_demo import app  # noqa: E402
from angelspec_hf.spaces_demo.app import (  # noqa: E402
    DemoModels, TokenTexts, acceptance_by_position, block_control, build_demo, generate_api, render_tokens,
    token_origins,
)

pytestmark = pytest.mark.real_model
NEW_TOKENS = 20
PROMPT = "Write a Python function that returns the largest of three numbers."


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def space():
    target, tokenizer = angelspec_hf.load_default_target()
    demo = build_demo(DemoModels(target, tokenizer, warmup=False))
    demo.queue().launch(server_name="127.0.0.1", server_port=free_port(), prevent_thread_lock=True, quiet=True)
    input_ids = chat_input_ids(tokenizer, PROMPT)
    reference = target.generate(input_ids, max_new_tokens=NEW_TOKENS, do_sample=False)[0, input_ids.shape[1]:]
    try:
        yield Client(demo.local_url, verbose=False), tokenizer, tokenizer.decode(reference, skip_special_tokens=True), \
            target
    finally:
        demo.close()


@pytest.mark.parametrize("drafter,block_size", [("dfly", 4), ("mtp", 3), ("auto", 8)])
def test_generate_returns_the_target_greedy_text_and_consistent_stats(space, drafter, block_size):
    client, _, reference, _ = space
    result = client.predict(PROMPT, drafter, block_size, 0.0, NEW_TOKENS, api_name="/generate")
    s = result["stats"]
    assert result["text"] == reference and result["plain_text"] == reference
    assert s["identical_to_plain"] is True
    assert s["new_tokens"] == NEW_TOKENS == s["tokens_from_drafter"] + s["tokens_from_target"]
    assert s["tokens_from_drafter"] == sum(s["accepted"]) == sum(t["origin"] == "draft" for t in result["tokens"])
    assert len(s["accepted"]) == len(s["proposed"]) == s["rounds"]
    assert s["mean_accepted_length"] == pytest.approx((sum(s["accepted"]) + s["rounds"]) / s["rounds"])
    assert len(s["acceptance_by_position"]) == max(s["proposed"]) <= max(s["draft_tokens_per_round"],
                                                                          s["lookup_tokens_per_round"])
    assert 0 <= s["corpus_rounds"] <= s["lookup_rounds"] <= s["rounds"]
    assert "".join(t["text"] for t in result["tokens"]) == result["text"]
    assert result["tokens"][0]["origin"] == "prefill"
    if drafter == "auto":
        assert (s["drafter"], s["routed_domain"]) == ("dfly", "code")  # a code prompt goes to DFly
    elif not s["trained"]:  # an untrained drafter is built for the requested block size
        assert s["block_size"] == block_size
    assert s["speedup"] == pytest.approx(s["spec_tokens_per_s"] / s["plain_tokens_per_s"])


def test_ui_endpoint_streams_coloured_tokens(space):
    client, _, reference, _ = space
    job = client.submit(PROMPT, "dfly", 4, 0.0, 12, api_name="/compare")
    plain, _, spec_html, _, summary, chart = job.result()
    assert len(job.outputs()) > 2  # streamed: several updates before the last
    assert reference.startswith(plain)
    assert spec_html.count('class="tok ') == 12 and 'class="blk"' in spec_html and "tok-target" in spec_html
    assert "Speed-up" in summary and "Identical to plain greedy output: **yes**" in summary


def test_sampling_runs_and_counts_add_up(space):
    client, _, _, _ = space
    s = client.predict("Tell me a fun fact about owls.", "mtp", 3, 0.8, 8, api_name="/generate")["stats"]
    assert s["identical_to_plain"] is None and s["temperature"] == 0.8
    assert s["tokens_from_drafter"] + s["tokens_from_target"] == s["new_tokens"] <= 8


@pytest.mark.parametrize("prompt,kwargs,message", [
    ("", {}, "Please enter a prompt: it is empty"),
    ("   \n ", {}, "Please enter a prompt: it is empty"),
    ("x" * 9000, {}, "The prompt is too long: 9000 characters"),
    ("word " * 1500, {}, "tokens with the chat template; the limit is 1024"),
    ("Hi", {"max_new_tokens": 0}, "Max new tokens must be between 1 and 256"),
    ("Hi", {"drafter": "eagle"}, "Unknown drafter 'eagle'"),
])
def test_bad_input_gets_a_clear_error(space, prompt, kwargs, message):
    client, _, _, _ = space
    args = {"drafter": "dfly", "block_size": 8, "temperature": 0.0, "max_new_tokens": 8} | kwargs
    with pytest.raises(AppError, match=message):
        client.predict(prompt, *args.values(), api_name="/generate")


def test_batch_tab_is_lossless_under_fixed_depth_and_dcut(space):
    client, _, _, _ = space
    fixed, fixed_steps, dcut, dcut_steps, verdict = client.predict("dfly", 2, 8, 3, api_name="/batch")
    assert "Same tokens under both policies for 2/2 requests (lossless" in verdict
    assert fixed.startswith("**Fixed depth 3**") and dcut.startswith("**D-Cut**")
    assert "step 1" in fixed_steps and "prefill" in dcut_steps


def test_trained_drafters_keep_their_block_and_mtp_is_capped(space, tmp_path, monkeypatch):
    """Saved drafters stand in for trained ones (as a Space's `drafters/` folder): DFly keeps its trained block, the
    MTP drafter's steps are capped by the block size control, and the text is still the target's."""
    _, tokenizer, reference, target = space
    # whole blocks (`draft_length="full"`), so the cap is what limits each round, whatever this machine's timing
    MTPDrafter.from_target(target, num_draft_tokens=4, draft_length="full").save_pretrained(
        tmp_path / "smollm2-135m-instruct-mtp")
    DFlyDrafter.from_target(target, block_size=6).save_pretrained(tmp_path / "smollm2-135m-instruct-dfly")
    monkeypatch.setattr(app, "SPACE_DRAFTERS", tmp_path)
    monkeypatch.setattr(app, "shipped_drafter_path", lambda family: None)  # only the stand-ins count here
    monkeypatch.setattr("angelspec_hf.shipped.find_shipped", lambda family, cache_dir=None, why=None: None)
    models = DemoModels(target, tokenizer, warmup=False)
    models.wait()
    assert models.trained == {"dfly": True, "dflash": False, "mtp": True}
    assert models.sources["dfly"] == f"the shipped dfly drafter from {tmp_path / 'smollm2-135m-instruct-dfly'}"
    assert "untrained" in models.status_markdown()
    assert block_control("dfly") == {"__type__": "update", "interactive": False, "value": 6,
                                     "info": "Fixed at 6 by the trained DFly drafter (it denoises whole blocks)."}
    assert block_control("mtp")["maximum"] == 5 and block_control("dflash")["interactive"]
    with models.drafter_for("dfly", 3) as drafter:
        assert drafter.num_draft_tokens == 5
    result = generate_api(models, PROMPT, "mtp", 3, 0.0, NEW_TOKENS)
    assert result["text"] == reference and result["stats"]["trained"]
    assert result["stats"]["block_size"] == 3 and max(result["stats"]["proposed"]) == 2
    assert models.drafters["mtp"].num_draft_tokens == 4  # the cap is undone after the call


def test_acceptance_by_position_counts_only_rounds_that_proposed_that_far():
    # rounds: proposed 3 accepted 2; proposed 3 accepted 0; proposed 1 accepted 1
    assert acceptance_by_position([3, 3, 1], [2, 0, 1]) == [2 / 3, 1 / 2, 0.0]
    assert acceptance_by_position([], []) == []


def test_origins_and_html_mark_rounds():
    chunks = [[5], [6, 7, 8], [9]]  # prefill; a round with 2 accepted + 1 target; a round with none accepted
    assert token_origins(chunks) == [("prefill", 0), ("draft", 1), ("draft", 1), ("target", 1), ("target", 2)]
    page = render_tokens(["a", "<b>", "c", "d", "e"], chunks)
    assert page.count('class="blk"') == 3 and page.count("tok-draft") == 2 and page.count("tok-target") == 3
    assert "&lt;b&gt;" in page  # text is escaped


def test_token_texts_concatenate_to_the_decoded_text(space):
    _, tokenizer, _, _ = space
    ids = tokenizer("Café ☕ costs 3€ 🦉!", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    texts = TokenTexts(tokenizer)
    for i in range(0, len(ids), 3):
        texts.extend(ids[i:i + 3])
    assert "".join(texts.pieces) == texts.finish() == tokenizer.decode(ids, skip_special_tokens=True)
    assert len(texts.pieces) == len(ids)


def test_cli_has_the_demo_command():
    from angelspec_hf.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["demo", "--help"])
    assert exit_info.value.code == 0


def test_closing_stops_loading_at_the_next_stage_and_joins_the_loader(monkeypatch):
    """At exit (`atexit` runs `close`), the loading thread finishes the stage it is in, loads nothing more and is
    joined, so no thread is left inside torch while the interpreter tears down."""
    import threading

    entered, release = threading.Event(), threading.Event()

    def slow_target(**kwargs):
        entered.set()
        release.wait(30)
        return DEMO_TARGET()

    monkeypatch.setattr(angelspec_hf, "load_default_target", slow_target)
    models = app.DemoModels(warmup=False)
    models.start()
    assert entered.wait(30)
    closer = threading.Thread(target=models.close)
    closer.start()
    closer.join(0.3)
    assert closer.is_alive()  # it waits for the stage in progress...
    release.set()
    closer.join(30)
    assert not closer.is_alive() and not models._thread.is_alive()  # ...then the loader is gone
    assert models.ready.is_set() and models.drafters == {} and "shutting down" in str(models.error)


def DEMO_TARGET():
    from helpers import tiny_chat_target

    return tiny_chat_target()


def test_a_script_that_builds_the_demo_and_returns_exits_cleanly():
    """`build_demo()` starts loading in a thread; the script returns while it loads: exit code 0, no abort."""
    import subprocess
    import sys

    code = "from angelspec_hf.spaces_demo.app import build_demo\nbuild_demo()\nprint('built', flush=True)\n"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                         env=os.environ | {"GRADIO_ANALYTICS_ENABLED": "False"})
    assert run.returncode == 0, run.stderr[-2000:]
    assert "built" in run.stdout and "terminate called" not in run.stderr
