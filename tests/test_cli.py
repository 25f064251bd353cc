"""What a user meets first in `angelspec`: `--help` lists every command on one line, every command's `--help` ends with
examples that parse, and `angelspec generate` states a run without drafter rounds as such (never a τ of "nan"), with
the n-gram lookups' own figures when lookups were what ran."""

import argparse
import json
import os
import re
import shlex
import subprocess
import sys

import pytest

from angelspec_hf.cli import accepted_length_summary, build_parser, main
from angelspec_hf.modeling import SpeculationStats
from helpers import tiny_chat_target, tiny_drafter

SETTING = re.compile(r"^mean accepted len  : (.*)$", re.MULTILINE)


def commands() -> dict[str, argparse.ArgumentParser]:
    [sub] = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(sub.choices)


def help_text(capsys, argv) -> str:
    with pytest.raises(SystemExit) as done:
        main(argv)
    assert done.value.code == 0
    return capsys.readouterr().out


def example_lines(text: str) -> list[str]:
    """The `angelspec ...` command lines of a help's closing examples (continuation lines joined)."""
    examples = text[text.rindex("\nexample"):]
    joined = re.sub(r"\\\n\s*", " ", examples)
    return [line.strip() for line in joined.splitlines() if line.strip().startswith("angelspec ")]


def test_top_level_help_lists_every_command_on_one_line():
    run = subprocess.run([sys.executable, "-m", "angelspec_hf.cli", "--help"], capture_output=True, text=True,
                         env=dict(os.environ, COLUMNS="80"), timeout=300)
    assert run.returncode == 0, run.stderr
    block = run.stdout.split("\ncommands:\n", 1)[1].split("\n\n", 1)[0].splitlines()
    assert block[0].strip() == "COMMAND"
    listed = [line.split(None, 1) for line in block[1:]]
    # one line per command: no wrapped continuation lines, and every command has its help beside it
    assert [name for name, _ in listed] == list(commands()) and all(len(pair) == 2 for pair in listed)
    assert all(len(line) <= 80 for line in block)
    assert example_lines(run.stdout) and "nan" not in run.stdout


@pytest.mark.parametrize("command", list(commands()))
def test_every_command_help_ends_with_examples_that_parse(command, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")
    text = help_text(capsys, [command, "--help"])
    assert text.startswith(f"usage: angelspec {command}")
    tail = text.rstrip().rsplit("\n\n", 1)[1]
    assert tail.startswith(("examples:\n", "example:\n")), f"`angelspec {command} --help` ends with:\n{tail}"
    lines = example_lines(text)
    assert lines and all(line.startswith(f"angelspec {command}") for line in lines)
    for line in lines:
        argv = shlex.split(line, comments=True)[1:]
        if command != "train":
            build_parser().parse_args(argv)  # exits (failing the test) on an unknown flag or a bad value
        elif not argv[1].endswith((".yaml", ".yml", ".json")):
            from transformers import HfArgumentParser

            from angelspec_hf.trainer.arguments import DrafterTrainingArguments
            from angelspec_hf.trainer.run import ModelArguments

            HfArgumentParser((ModelArguments, DrafterTrainingArguments)).parse_args(argv[1:])


def test_accepted_length_summary_tells_drafter_rounds_from_lookups():
    drafted = SpeculationStats(proposed=[4, 4, 3], accepted=[2, 0, 3], lookup_rounds=1, plain_steps=2)
    assert accepted_length_summary([drafted]) == (
        "2.67 tokens per target forward (bonus token included), over 3 rounds in 1 run (1 of them n-gram lookups); "
        "2 plain steps, where drafting was not expected to pay")
    lookups = SpeculationStats(proposed=[5, 5], accepted=[4, 1], lookup_rounds=2, plain_steps=1)
    assert accepted_length_summary([lookups, SpeculationStats()]) == (
        "no drafter rounds in 2 runs (1 plain step, where drafting was not expected to pay); "
        "n-gram lookups: 3.50 tokens per target forward over 2 rounds")
    assert accepted_length_summary([SpeculationStats()]) == "no drafter rounds in 1 run; no n-gram lookups either"


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """A tiny target with the real tokenizer (favoured tokens: its replies repeat, so n-gram lookups find matches) and
    a DFly drafter for it with the cost-aware draft length and n-gram lookups on, both saved as HF folders."""
    root = tmp_path_factory.mktemp("cli")
    target, tokenizer = tiny_chat_target()
    target.save_pretrained(root / "target")
    tokenizer.save_pretrained(root / "target")
    tiny_drafter("dfly", target, draft_length="auto", lookup_tokens=10).save_pretrained(root / "drafter")
    return root


def generate(folders, capsys, *extra) -> str:
    assert main(["generate", "--target", str(folders / "target"), "--drafter", str(folders / "drafter"),
                 "--repeats", "1", "--threads", "1", "--linear-kernels", "stock", *extra]) == 0
    return capsys.readouterr().out


def test_generate_without_drafter_rounds_says_so(folders, capsys, monkeypatch, tmp_path):
    costs = tmp_path / "costs"
    monkeypatch.setenv("ANGELSPEC_COST_MODELS", str(costs))
    # one new token: the prefill gives it, nothing is verified
    out = generate(folders, capsys, "--max-new-tokens", "1")
    assert "identical to plain : yes" in out
    assert SETTING.search(out)[1] == "no drafter rounds in 1 run; no n-gram lookups either"
    # The round costs the draft-length policy profiled (its warm-up): made to say drafting never pays, and every
    # target step costs the same whatever it verifies. Every round is then a plain step or an n-gram lookup (the
    # policy also learns from the rounds it times, so whether a lookup pays varies with the machine's timings).
    [profile] = costs.glob("hook-*.json")
    data = json.loads(profile.read_text())
    profile.write_text(json.dumps(data | {"step_coef": [1e-3, 0.0], "plain_step": 1e-3, "draft_coef": [1e6, 1e6]}))
    out = generate(folders, capsys, "--max-new-tokens", "32")
    assert "identical to plain : yes" in out
    line = SETTING.search(out)[1]
    assert re.fullmatch(r"no drafter rounds in 1 run( \(\d+ plain steps?, where drafting was not expected to pay\))?; "
                        r"(n-gram lookups: \d+\.\d\d tokens per target forward over [1-9]\d* rounds"
                        r"|no n-gram lookups either)", line), line
    assert "nan" not in line.lower()


def test_generate_says_where_it_looks_up_and_takes_a_corpus(folders, capsys, tmp_path):
    """`--lookup-corpus <regenerated replies>` gives the drafter a corpus to look up in, and the output says so;
    'none' (a drafter of a folder has none anyway) keeps n-gram lookups alone; a folder without replies is an error
    that names what it looked for."""
    replies = tmp_path / "regenerated"
    replies.mkdir()
    (replies / "mine.jsonl").write_text(json.dumps({"id": "0", "response_ids": [5, 6, 7, 5, 6, 8]}) + "\n")
    out = generate(folders, capsys, "--max-new-tokens", "8", "--lookup-corpus", str(replies))
    assert "identical to plain : yes" in out
    assert "lookups            : up to 10 tokens, n-gram in the context and in a corpus of 1 earlier replies " \
           "(6 tokens)" in out
    out = generate(folders, capsys, "--max-new-tokens", "8", "--lookup-corpus", "none")
    assert "lookups            : up to 10 tokens, n-gram in the context\n" in out
    off = tmp_path / "lookups-off"  # a drafter whose config has lookups off: asking for a corpus turns them on
    tiny_drafter("dfly", tiny_chat_target()[0], draft_length="auto", lookup_tokens=0).save_pretrained(off)
    assert main(["generate", "--target", str(folders / "target"), "--drafter", str(off), "--repeats", "1",
                 "--threads", "1", "--linear-kernels", "stock", "--max-new-tokens", "8",
                 "--lookup-corpus", str(replies)]) == 0
    assert "lookups            : up to 10 tokens, n-gram in the context and in a corpus" in capsys.readouterr().out
    assert main(["generate", "--target", str(folders / "target"), "--drafter", str(folders / "drafter"),
                 "--lookup-corpus", str(tmp_path / "nowhere")]) == 2
    err = capsys.readouterr().err
    assert "--lookup-corpus" in err and "no regenerated responses" in err and "Traceback" not in err
