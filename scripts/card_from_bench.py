"""Write the acceptance an `angelspec bench` run measured into a drafter's model card (its "Measured acceptance"
table): τ and first-token acceptance per EVAL set and temperature, for the bench method that drafted whole blocks.

    python scripts/card_from_bench.py outputs/bench/results.json dfly_full drafters/smollm2-135m-instruct-dfly
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

from angelspec_hf.trainer.model_card import ACCEPTANCE_HEADER, acceptance_rows


def acceptance_from_bench(results: dict, method: str) -> dict:
    groups: dict = {}
    for r in results["records"]:
        if r["method"] == method and r["accepted_per_round"] is not None:
            groups.setdefault((r["set"], r["temperature"]), []).append(r)
    out = {}
    for key, records in sorted(groups.items()):
        rounds = [a for r in records for a in r["accepted_per_round"]]
        out[key] = {"tau": sum(r["new_tokens"] - 1 for r in records) / max(sum(r["target_forwards"] - 1 for r in records), 1),
                    "first": sum(a >= 1 for a in rounds) / max(len(rounds), 1), "prompts": len(records),
                    "tokens": max(r["new_tokens"] for r in records)}
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results")
    parser.add_argument("method")
    parser.add_argument("drafter_dir")
    args = parser.parse_args(argv)
    results = json.loads(Path(args.results).read_text())
    acceptance = acceptance_from_bench(results, args.method)
    if not acceptance:
        raise SystemExit(f"no records of method {args.method!r} in {args.results}")
    card = Path(args.drafter_dir) / "README.md"
    text = card.read_text()
    config = json.loads((Path(args.drafter_dir) / "config.json").read_text())
    block = config.get("block_size")
    desc = f"block size {block}" if block else f"{config.get('num_draft_tokens')} draft tokens per round"
    rows = acceptance_rows(acceptance, desc)
    table = re.compile(r"\| eval set \|[^\n]*\n\|[-| ]+\|\n(?:\|[^\n]*\n)*")
    if not table.search(text):
        raise SystemExit(f"{card} has no acceptance table")
    setting = results["meta"]["setting"]
    text = table.sub(lambda m: ACCEPTANCE_HEADER + "\n" + rows + "\n", text, count=1)
    text = re.sub(r"\n_Measured by `angelspec bench`[^\n]*\n", "\n", text)
    text = text.replace(rows + "\n", rows + f"\n\n_Measured by `angelspec bench` ({setting})._\n", 1)
    card.write_text(text)
    print(rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
