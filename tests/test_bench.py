"""`angelspec bench` on a tiny target saved as an HF folder: every method runs, outputs are written, greedy outputs
are identical to AR's, and AR's τ is exactly 1."""

import json

import pytest
import torch

from angelspec_hf.cli import main
from helpers import tiny_chat_target


def test_bench_writes_table_json_and_plots(tmp_path):
    target, tokenizer = tiny_chat_target()
    target.save_pretrained(tmp_path / "target")
    tokenizer.save_pretrained(tmp_path / "target")
    prompts = tmp_path / "mine.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": p}) for p in ["What is 2 + 2?", "Write a haiku."]) + "\n")
    torch.manual_seed(0)
    code = main(["bench", "--target", str(tmp_path / "target"), "--prompts", str(prompts), "--prompts-per-set", "2",
                 "--max-new-tokens", "12", "--temperatures", "0,1", "--threads", "1", "--linear-kernels", "prepacked",
                 "--out", str(tmp_path / "out")])
    assert code == 0
    result = json.loads((tmp_path / "out" / "results.json").read_text())
    rows = {(r["method"], r["temperature"]): r for r in result["summary"]}
    assert {m for m, _ in rows} == {"ar", "ar_stock", "prompt_lookup", "dflash_builtin", "mtp", "mtp_full", "mtp+lookup", "dflash",
                                    "dflash_full", "dflash+lookup", "dfly", "dfly_full", "dfly+lookup", "dfly+corpus",
                                    "router"}
    lookups = [r["lookup_rounds"] for r in result["records"] if r["method"].endswith("+lookup")]
    assert all(n is not None for n in lookups) and not any(
        r["lookup_rounds"] for r in result["records"] if r["method"] in ("dfly", "dfly_full"))
    assert rows[("ar", 0.0)]["tau"] == 1.0 and rows[("ar", 0.0)]["speedup"] == 1.0
    # the round split: AR never drafts; whole blocks always do; the parts add up to the time per forward
    assert rows[("ar", 0.0)]["round_draft"] == 0 and rows[("dfly_full", 0.0)]["round_draft"] > 0
    ar = rows[("ar", 0.0)]
    assert ar["round_verify"] + ar["round_overhead"] == pytest.approx(1.0)
    assert all(r["identical"] for (m, t), r in rows.items() if t == 0.0 and m != "ar_stock")
    # every method ran on the prepacked target; `ar_stock` timed the stock kernels beside it
    assert "linear kernels: oneDNN prepacked" in result["meta"]["setting"]
    assert rows[("ar_stock", 0.0)]["tau"] == 1.0 and rows[("ar_stock", 0.0)]["round_draft"] == 0
    assert result["meta"]["untrained"] == ["dflash", "dfly", "mtp"]
    for name in ("results.md", "speedup_T0.png", "speedup_T1.png", "acceptance_by_position.png"):
        assert (tmp_path / "out" / name).stat().st_size > 0
    table = (tmp_path / "out" / "results.md").read_text()
    assert "| mine | 0 | dfly | 2 |" in table
    assert "| method | mine T=0 | mine T=1 | round at T=0" in table and "| ar | 1.00x (1.00) | 1.00x (1.00) | 0.00 + " in table


def test_a_drafter_named_by_folder_runs_like_a_shipped_one(tmp_path):
    """`--drafters label=<folder>` with a drafter stored in fp16 (as shipped ones are): it runs in the target's fp32,
    its linears prepacked like the target's, not as slow fp16 CPU matmuls."""
    from helpers import tiny_drafter

    target, tokenizer = tiny_chat_target()
    target.save_pretrained(tmp_path / "target")
    tokenizer.save_pretrained(tmp_path / "target")
    tiny_drafter("dfly", target).half().save_pretrained(tmp_path / "mine")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "What is 2 + 2?"}) + "\n")
    assert main(["bench", "--target", str(tmp_path / "target"), "--prompts", str(prompts), "--prompts-per-set", "1",
                 "--max-new-tokens", "6", "--temperatures", "0", "--threads", "1", "--methods", "ar,mine", "--drafters",
                 f"mine={tmp_path / 'mine'}", "--linear-kernels", "prepacked", "--out", str(tmp_path / "out")]) == 0
    result = json.loads((tmp_path / "out" / "results.json").read_text())
    linears = sum(isinstance(m, torch.nn.Linear) for model in (target, tiny_drafter("dfly", target))
                  for m in model.modules())
    assert f"oneDNN prepacked ({linears} linears)" in result["meta"]["setting"]
    assert {r["method"] for r in result["summary"]} == {"ar", "mine"} and all(r["identical"] for r in result["summary"])


def test_concurrency_bench_reports_every_method_and_checks_identity(tmp_path):
    """The closed-loop batched benchmark: plain, fixed depths and D-Cut per concurrency, with greedy identity against
    plain decoding, a markdown table, JSON and a plot."""
    from angelspec_hf.bench_batch import run_concurrency_bench, write_concurrency_outputs
    from angelspec_hf.policy import CostModel
    from helpers import tiny_drafter, tiny_target

    from angelspec_hf.policy import CorpusIndex

    target = tiny_target()
    drafters = {"dfly": tiny_drafter("dfly", target, lookup_tokens=4), "mtp": tiny_drafter("mtp", target)}
    drafters["dfly"].lookup_corpus = CorpusIndex([[5, 6, 7, 8, 9, 10], [9, 9, 9, 4]])
    prompts = [[5, 6, 7], [9] * 12, [4, 3, 8, 8]]
    cache = tmp_path / "cost"
    records = run_concurrency_bench(target, drafters, prompts, [1, 3], requests_per_client=2, max_new_tokens=6,
                                    fixed_depths=(1, 3), cost_model_cache=cache, repeats=2)
    # D-Cut with the drafter's lookups (n-gram and corpus), with n-gram lookups alone, and without lookups
    methods = ["plain", "dfly-depth:1", "dfly-depth:3", "dfly-dcut", "dfly-dcut-ngram", "dfly-dcut-nolookup",
               "mtp-dcut"]
    assert [r["method"] for r in records] == methods * 2
    assert all(r["identical"] and r["tokens"] == r["requests"] * 6 and r["repeats"] == 2 for r in records)
    assert all(r["speedup"] == r["speedup_min"] == r["speedup_max"] == 1.0 for r in records if r["method"] == "plain")
    assert all(r["speedup_min"] <= r["speedup"] <= r["speedup_max"] for r in records)
    paths = write_concurrency_outputs(records, tmp_path / "out", "test")
    assert "| 3 | dfly-dcut |" in paths["markdown"].read_text() and paths["plot"].stat().st_size > 0
    assert json.loads(paths["json"].read_text())["records"][0]["method"] == "plain"
    assert isinstance(CostModel.from_dict(json.loads(next(cache.glob("*.json")).read_text())), CostModel)


def test_spec_bench_sets():
    from angelspec_hf.prompts import SPEC_BENCH_CATEGORIES, load_eval_prompts

    mixed = load_eval_prompts("spec_bench", 13)
    assert len(set(mixed)) == 13  # one per category, round robin
    assert [len(load_eval_prompts(f"spec_bench:{c}")) for c in ("coding", "translation")] == [5, 40]
    assert all(load_eval_prompts(f"spec_bench:{c}", 1) for c in SPEC_BENCH_CATEGORIES)
    with pytest.raises(ValueError, match="category"):
        load_eval_prompts("spec_bench:poetry")


def test_percentile_is_nearest_rank():
    from angelspec_hf.bench_batch import percentile

    values = list(range(100, 0, -1))  # 1..100, unsorted
    assert percentile(values, 99) == 99 and percentile(values, 50) == 50 and percentile(values, 100) == 100
    assert percentile([3.0, 1.0], 99) == 3.0 and percentile([3.0, 1.0], 50) == 1.0 and percentile([7], 1) == 7
    assert percentile([], 99) is None


def test_each_method_sets_its_drafters_whatever_ran_before():
    """Methods share drafter objects: each sets what it measures. The router's drafters once kept the settings of
    the last method run on them (lookups on or off by the order of --methods)."""
    from angelspec_hf.bench import LOOKUP_TOKENS, method_kwargs
    from angelspec_hf.router import DrafterRouter
    from helpers import tiny_drafter

    target, tokenizer = tiny_chat_target()
    drafters = {"mtp": tiny_drafter("mtp", target), "dfly": tiny_drafter("dfly", target)}
    drafters["router"] = DrafterRouter({"mtp": drafters["mtp"], "dfly": drafters["dfly"]}, tokenizer)
    for before in ("mtp", "dfly_full", "dfly+lookup"):
        method_kwargs(before, drafters)
        assert method_kwargs("router", drafters)["assistant_model"] is drafters["router"]
        assert all(d.config.lookup_tokens == LOOKUP_TOKENS and d.config.draft_length == "auto"
                   for d in (drafters["mtp"], drafters["dfly"]))
    method_kwargs("dfly_full", drafters)
    assert drafters["dfly"].config.draft_length == "full" and drafters["dfly"].config.lookup_tokens == 0
    method_kwargs("dfly_full+lookup", drafters)  # whole blocks, and a lookup whenever one matches
    assert drafters["dfly"].config.draft_length == "full" and drafters["dfly"].config.lookup_tokens == LOOKUP_TOKENS
    corpus = object()
    method_kwargs("dfly+corpus", drafters, {"dfly": corpus})  # the corpus only for +corpus, whatever ran before
    assert drafters["dfly"].lookup_corpus is corpus and drafters["dfly"].config.lookup_tokens == LOOKUP_TOKENS
    assert drafters["dfly"].config.draft_length == "auto"
    method_kwargs("router", drafters)
    assert drafters["dfly"].lookup_corpus is None
    for method in ("dfly+corpus", "dfly+lookup"):
        method_kwargs(method, drafters, {"dfly": corpus})
    assert drafters["dfly"].lookup_corpus is None


def test_corpus_lookups_run_beside_the_drafter_and_stay_lossless(tmp_path):
    """`dfly+corpus --lookup-corpus <regenerated replies>`: rounds that verify a lookup in a corpus of the target's
    own earlier replies to these prompts (so lookups there are on offer and accepted), greedy output identical to
    AR's; `dfly+lookup` beside it never looks in the corpus."""
    from helpers import tiny_drafter

    target, tokenizer = tiny_chat_target(favour=1.0)  # varied replies: the context alone rarely predicts them
    target.save_pretrained(tmp_path / "target")
    tokenizer.save_pretrained(tmp_path / "target")
    tiny_drafter("dfly", target).save_pretrained(tmp_path / "dfly")
    asks = ["What is 2 + 2?", "Write a haiku.", "Name three colours."]
    (tmp_path / "p.jsonl").write_text("\n".join(json.dumps({"prompt": p}) for p in asks) + "\n")
    from angelspec_hf.prompts import chat_input_ids

    replies = tmp_path / "regenerated"
    replies.mkdir()
    with open(replies / "mine.jsonl", "w") as f:
        for i, p in enumerate(asks):
            ids = chat_input_ids(tokenizer, p)
            out = target.generate(ids, max_new_tokens=24, do_sample=False)
            f.write(json.dumps({"id": str(i), "response_ids": out[0, ids.shape[1]:].tolist()}) + "\n")
    assert main(["bench", "--target", str(tmp_path / "target"), "--prompts", str(tmp_path / "p.jsonl"),
                 "--prompts-per-set", "3", "--max-new-tokens", "24", "--temperatures", "0", "--threads", "1",
                 "--methods", "ar,dfly+lookup,dfly+corpus", "--drafters", f"dfly={tmp_path / 'dfly'}",
                 "--lookup-corpus", str(replies), "--out", str(tmp_path / "out")]) == 0
    result = json.loads((tmp_path / "out" / "results.json").read_text())
    records = result["records"]
    assert all(r["identical"] for r in records)
    assert sum(r["corpus_rounds"] for r in records if r["method"] == "dfly+corpus") > 0
    assert not any(r["corpus_rounds"] for r in records if r["method"] == "dfly+lookup")


def test_whole_blocks_with_lookups_run_when_named(tmp_path):
    """`<family>_full+lookup` is not in the default list but runs when named, lossless, with lookup rounds; a name
    that is none of the methods is refused."""
    target, tokenizer = tiny_chat_target()
    target.save_pretrained(tmp_path / "target")
    tokenizer.save_pretrained(tmp_path / "target")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "Repeat: one two three, one two three, one two three."}) + "\n")
    args = ["bench", "--target", str(tmp_path / "target"), "--prompts", str(prompts), "--prompts-per-set", "1",
            "--max-new-tokens", "24", "--temperatures", "0", "--threads", "1", "--linear-kernels", "stock",
            "--out", str(tmp_path / "out")]
    assert main(args + ["--methods", "ar,dfly_full+lookup"]) == 0
    result = json.loads((tmp_path / "out" / "results.json").read_text())
    assert {r["method"] for r in result["summary"]} == {"ar", "dfly_full+lookup"}
    assert all(r["identical"] for r in result["summary"])
    assert all(r["lookup_rounds"] is not None for r in result["records"] if r["method"] == "dfly_full+lookup")
    with pytest.raises(SystemExit, match="dfly_full\\+lookup"):
        main(args + ["--methods", "ar,dfly_whole+lookup"])


def test_draft_stop_threshold_is_set_for_every_drafter_alike():
    """`--draft-stop-threshold` gives every drafter, the router's included, the same cut of its `_full` drafts; None
    keeps each one's own, and a value outside [0, 1) is refused."""
    from angelspec_hf.bench import set_stop_threshold
    from angelspec_hf.router import DrafterRouter
    from helpers import tiny_drafter

    target, tokenizer = tiny_chat_target()
    drafters = {"dfly": tiny_drafter("dfly", target, draft_stop_threshold=0.4),
                "dflash": tiny_drafter("dflash", target, draft_stop_threshold=0.02)}
    drafters["router"] = DrafterRouter({"mtp": tiny_drafter("mtp", target, draft_stop_threshold=0.3),
                                        "dfly": drafters["dfly"]}, tokenizer)
    set_stop_threshold(drafters, None)
    assert [drafters[f].config.draft_stop_threshold for f in ("dfly", "dflash")] == [0.4, 0.02]
    set_stop_threshold(drafters, 0.0)
    assert all(d.config.draft_stop_threshold == 0.0 for d in
               (drafters["dfly"], drafters["dflash"], *drafters["router"].drafters.values()))
    with pytest.raises(ValueError, match=r"--draft-stop-threshold must be in \[0, 1\), got 1.0"):
        set_stop_threshold(drafters, 1.0)


def test_speedup_interval_is_a_paired_bootstrap_over_prompts():
    """The interval pairs each prompt with AR's run of it: a method exactly twice as fast on every prompt has no spread
    whatever the prompts' lengths, and one that is faster on some prompts and slower on others brackets its total."""
    from angelspec_hf.bench import speedup_interval, summarise

    def rec(method, tokens, seconds, i):
        return {"set": "s", "temperature": 0.0, "method": method, "new_tokens": tokens, "seconds": seconds,
                "target_forwards": tokens, "draft_seconds": None, "forward_seconds": seconds, "identical": True,
                "prompt": i}

    ar = [rec("ar", 100, s, i) for i, s in enumerate([1.0, 5.0, 2.0, 9.0, 3.0, 4.0])]
    twice = [rec("x", 100, a["seconds"] / 2, i) for i, a in enumerate(ar)]
    lo, hi = speedup_interval(twice, ar)
    assert lo == pytest.approx(2.0) and hi == pytest.approx(2.0)
    # unpaired resampling would spread this one: the prompts' own speeds differ by 9x
    mixed = [rec("y", 100, a["seconds"] * f, i) for i, (a, f) in enumerate(zip(ar, [0.5, 1.5, 0.8, 1.2, 0.6, 1.4]))]
    lo, hi = speedup_interval(mixed, ar)
    total = (600 / sum(r["seconds"] for r in mixed)) / (600 / sum(a["seconds"] for a in ar))
    assert lo < total < hi and hi - lo > 0.1
    assert speedup_interval(mixed, ar) == (lo, hi)  # seeded: the same run reports the same interval
    row = next(r for r in summarise(ar + twice) if r["method"] == "x")
    assert row["speedup_ci95"] == pytest.approx((2.0, 2.0)) and row["speedup"] == pytest.approx(2.0)
