"""`angelspec bench` on a tiny target saved as an HF folder: every method runs, outputs are written, greedy outputs
are identical to AR's, and AR's τ is exactly 1."""

import json

import torch

from angelspec_hf.cli import main
from conftest import tiny_chat_target


def test_bench_writes_table_json_and_plots(tmp_path):
    target, tokenizer = tiny_chat_target()
    target.save_pretrained(tmp_path / "target")
    tokenizer.save_pretrained(tmp_path / "target")
    prompts = tmp_path / "mine.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": p}) for p in ["What is 2 + 2?", "Write a haiku."]) + "\n")
    torch.manual_seed(0)
    code = main(["bench", "--target", str(tmp_path / "target"), "--prompts", str(prompts), "--prompts-per-set", "2",
                 "--max-new-tokens", "12", "--temperatures", "0,1", "--threads", "1", "--out", str(tmp_path / "out")])
    assert code == 0
    result = json.loads((tmp_path / "out" / "results.json").read_text())
    rows = {(r["method"], r["temperature"]): r for r in result["summary"]}
    assert {m for m, _ in rows} == {"ar", "prompt_lookup", "dflash_builtin", "mtp", "dflash", "dfly", "router"}
    assert rows[("ar", 0.0)]["tau"] == 1.0 and rows[("ar", 0.0)]["speedup"] == 1.0
    assert all(r["identical"] for (m, t), r in rows.items() if t == 0.0)
    assert result["meta"]["untrained"] == ["dflash", "dfly", "mtp"]
    for name in ("results.md", "speedup_T0.png", "speedup_T1.png", "acceptance_by_position.png"):
        assert (tmp_path / "out" / name).stat().st_size > 0
    assert "| mine | 0 | dfly | 2 |" in (tmp_path / "out" / "results.md").read_text()
