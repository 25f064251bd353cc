#!/usr/bin/env python3
"""Mutation check of the lossless guarantee: apply each known-wrong rule, alone, to a scratch copy of the
repository, run the tests named for it, and report whether they caught it. Exit status 1 if any mutation survives
(or a named test is missing, or the unmutated copy does not pass its tests).

    .venv/bin/python scripts/mutation_check.py            # everything (several minutes on 2 cores)
    .venv/bin/python scripts/mutation_check.py --only temperature --keep

Each mutation is a literal `old -> new` text replacement that must match exactly once in the copy: when the code it
targets has moved the script fails loudly instead of reporting a vacuous "survived" or "caught".

The scratch copy holds the working tree's tracked files and untracked, not ignored ones (`git ls-files -co
--exclude-standard`), as they are on disk. The package is installed editable from the real checkout, so the copy is
put first on PYTHONPATH, laid out as pyproject.toml's `package-dir` says (symlinks inside its `angelspec_hf/`); the
script checks that every `angelspec_hf` module the tests import resolves inside the copy, and a sanity
mutation (an exception in the engine) must be caught before anything else is believed.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

ENGINE_SAMPLING = "tests/test_engine.py::test_sampling_is_exact_in_every_verify_mode_with_power"
REFERENCE_LAW = "tests/test_kernels.py::test_reference_verify_keeps_the_target_distribution_with_power"
TRITON_LAW = "tests/test_kernels.py::test_triton_verify_keeps_the_target_distribution_with_power"
EQUIVALENCE = "tests/test_drafting_equivalence.py"
MEMORISE = "tests/test_memorisation.py::test_drafter_memorises_its_training_sequences"
SEEDED_REPRO = "tests/test_engine.py::test_a_seeded_request_gives_the_same_tokens_alone_in_a_crowd_and_beside_a_twin"
SEEDED_LAW = "tests/test_engine.py::test_seeded_sampling_is_exact_with_power"


@dataclass
class Mutation:
    name: str
    path: str
    old: str
    new: str
    tests: list[str]
    note: str = "exactness"  # the group it belongs to; "record": caught by older tests, kept for the record
    result: dict = field(default_factory=dict)


MUTATIONS = [
    Mutation("sanity: the engine raises (proves the scratch copy is what runs)", "angelspec_hf/policy/acceptance.py",
             "    return probs.max(-1).values\n",
             "    raise RuntimeError('mutation_check sanity mutation')\n",
             ["tests/test_engine.py::test_draft_confidence_does_not_look_at_the_drafted_token"], note="sanity"),
    # ---- exactness blind spots of the sampled paths ------------------------------------------------------------------------------------
    Mutation("engine ignores temperature", "tgi_patch/engine/verification.py",
             "[r.params.temperature if r.params.do_sample else 1.0 for r in requests]",
             "[1.0 for r in requests]",
             [f"{ENGINE_SAMPLING}[full-T0.7-topk-topp]", f"{ENGINE_SAMPLING}[depth:1-T0.7-topp]"]),
    Mutation("engine draft q without temperature/top-k/top-p (drawn from and reported raw: lossless, not as asked)",
             "tgi_patch/engine/verification.py",
             "        probs = process(logits, requests, 1)\n",
             "        probs = torch.softmax(logits.float(), -1)\n",
             ["tests/test_engine.py::test_verification_sees_the_processed_drafter_distribution",
              f"{EQUIVALENCE}::test_sampled_draft_distribution_equals_the_hooks"]),
    Mutation("engine draft q without temperature/top-k/top-p (drawn processed, reported raw: lossy)",
             "tgi_patch/engine/verification.py",
             "        return token, probs, conf\n",
             "        return token, torch.softmax(logits.float(), -1), conf\n",
             [f"{ENGINE_SAMPLING}[full-T0.7-topk-topp]", f"{ENGINE_SAMPLING}[depth:2-T0.7]"]),
    Mutation("reference.verify: correction from p instead of norm(max(p - q, 0))",
             "tgi_patch/engine/kernels/reference.py",
             "p = torch.where(use_residual[:, None], residual, p)",
             "p = torch.where(use_residual[:, None], p, p)",
             [REFERENCE_LAW, f"{ENGINE_SAMPLING}[full-T1]"]),
    Mutation("triton_kernels.verify: correction from p instead of norm(max(p - q, 0))",
             "tgi_patch/engine/kernels/triton_kernels.py",
             "q_ptr + (b * K + n_acc) * V, u, V, True, BLOCK_V)",
             "q_ptr + (b * K + n_acc) * V, u, V, False, BLOCK_V)",
             [TRITON_LAW]),
    Mutation("D-Cut confidence = q(drafted token) for sampled rows (the old rule)", "angelspec_hf/policy/acceptance.py",
             "    return probs.max(-1).values\n",
             "    return probs.gather(1, token[:, None]).squeeze(1)\n",
             [f"{ENGINE_SAMPLING}[auto-T1]", f"{ENGINE_SAMPLING}[budget16-T0.7]",
              "tests/test_engine.py::test_draft_confidence_does_not_look_at_the_drafted_token"]),
    Mutation("auto plan from the real keys (a sampled row's later positions)", "angelspec_hf/policy/acceptance.py",
             "return torch.where(sampled[:, None], accept[:, :1].expand_as(accept), accept)",
             "return accept",
             ["tests/test_engine.py::test_auto_selection_of_a_sampled_position_ignores_its_later_positions"]),
    Mutation("auto drafting width from the sampled rows' real later confidences (an earlier rule)",
             "tgi_patch/engine/dcut.py",
             "survival = survival * self.width_plan(torch.stack(accepts, 1), sampled)[:, -1]",
             "survival = survival * accepts[-1]",
             ["tests/test_engine.py::test_auto_drafts_a_sampled_row_as_wide_as_its_plan"], note="drafting width"),
    Mutation("fixed budget ranks sampled rows by their real survival (requests sharing a seed steer each other)",
             "tgi_patch/engine/dcut.py",
             "kernels.dcut_select(self.plan(accept, sampled), num_drafted, self.mode_value)",
             "kernels.dcut_select(accept, num_drafted, self.mode_value)",
             ["tests/test_engine.py::test_auto_selection_of_a_sampled_position_ignores_its_later_positions"],
             note="drafting width"),
    Mutation("page leak: PagedKVPool.release keeps one page off the free list", "tgi_patch/engine/paged.py",
             "self.free_pages.extend(self.owned[slot])",
             "self.free_pages.extend(self.owned[slot][1:])",
             [f"{EQUIVALENCE}::test_pages_return_to_the_free_list"]),
    Mutation("padding keys read from the pages' own (unwritten) slots instead of page 0", "tgi_patch/engine/paged.py",
             "return torch.where(valid, index, torch.zeros_like(index))",
             "return index",
             [f"{EQUIVALENCE}::test_kv_pages_are_never_read_before_they_are_written"]),
    Mutation("engine draft cache cropped one entry short", "tgi_patch/engine/drafting.py",
             "self.pool.set_lengths(slots_host, context_host, slots, context)",
             "self.pool.set_lengths(slots_host, [c - 1 for c in context_host], slots, context - 1)",
             [f"{EQUIVALENCE}::test_engine_drafts_what_the_hook_drafts"]),
    Mutation("engine MTP next-token feature shifted by one (_keep_features)", "tgi_patch/engine/model_runner.py",
             "after = torch.cat([fed[:, 1:], fed.new_zeros(len(fed), 1)], 1)",
             "after = fed",
             [f"{EQUIVALENCE}::test_engine_drafts_what_the_hook_drafts"]),
    Mutation("hook records one more accepted token than it did", "modeling/candidate_generator.py",
             "self.stats.accepted.append(int(num_matches))",
             "self.stats.accepted.append(int(num_matches) + 1)",
             [f"{EQUIVALENCE}::test_accepted_counts_match_a_hand_count"]),
    # ---- caught by older tests, for the record -------------------------------------------------------------------
    Mutation("accept one token too many (past the verified depth)", "tgi_patch/engine/kernels/reference.py",
             "in_depth = ar < depth[:, None]", "in_depth = ar <= depth[:, None]",
             ["tests/test_engine.py::test_greedy_equals_plain_decoding_for_any_mix", REFERENCE_LAW,
              f"{ENGINE_SAMPLING}[depth:2-T0.7]"], note="record"),
    Mutation("drop the bonus / correction token after accepted drafts", "tgi_patch/engine/scheduler.py",
             "count = 1 if first_step else n + 1", "count = 1 if first_step else max(n, 1)",
             ["tests/test_engine.py::test_greedy_equals_plain_decoding_for_any_mix", f"{ENGINE_SAMPLING}[full-T1]"],
             note="record"),
    Mutation("accept with min(1, q/p)", "tgi_patch/engine/kernels/reference.py",
             "u_accept.float() * q_d < p_d", "u_accept.float() * p_d < q_d",
             [REFERENCE_LAW, f"{ENGINE_SAMPLING}[full-T1]"], note="record"),
    Mutation("bonus token from the residual", "tgi_patch/engine/kernels/reference.py",
             "use_residual = rejected & (residual.sum(-1) > 0)", "use_residual = residual.sum(-1) > 0",
             [REFERENCE_LAW, f"{ENGINE_SAMPLING}[full-T1]"], note="record"),
    # ---- shadow probes (the hook's probes beside plain steps) ------------------------------------------
    Mutation("shadow probe samples its token (draws from the generation's random stream)",
             "modeling/candidate_generator.py",
             "            peak, token = probs.max(dim=-1)\n            shadow.update(",
             "            peak, token = probs.max(dim=-1)\n            token = torch.multinomial(probs, 1)[:, 0]\n"
             "            shadow.update(",
             ["tests/test_sampling.py::test_shadow_probes_leave_the_random_stream_alone"], note="shadow probes"),
    Mutation("shadow probe's acceptance is the chance that p's draw equals q's", "modeling/candidate_generator.py",
             "return float(torch.minimum(p, draft_probs.to(p.device, torch.float32)).sum())",
             "return float((p * draft_probs.to(p.device, torch.float32)).sum())",
             ["tests/test_sampling.py::test_a_shadow_drafts_acceptance_is_speculative_samplings_acceptance_rate"],
             note="shadow probes"),
    Mutation("shadow probe drafts without the plain steps' features", "modeling/candidate_generator.py",
             "self._shadow_draft(input_ids, self._catch_up(context))",
             "self._shadow_draft(input_ids, context)",
             ["tests/test_draft_policy.py::test_a_shadow_draft_scores_the_first_token_as_verifying_it_would"],
             note="shadow probes"),
    # ---- seeded sampling: Gumbel-max draws, drafts coupled to the same noise ----------------------------------
    Mutation("seeded requests rejection-sampled (the scheme before: tokens follow the batch)",
             "tgi_patch/engine/request.py",
             "return self.params.do_sample and self.params.seed is not None",
             "return False",
             [f"{SEEDED_REPRO}[5-no-lookups]", f"{SEEDED_REPRO}[full-lookups]"], note="seeded"),
    Mutation("seeded target draws keyed by the step's block offset instead of the position",
             "tgi_patch/engine/verification.py",
             "seeds[at[0]], gen_pos[at[0], at[1]])",
             "seeds[at[0]], (gen_pos - gen_pos[:, :1])[at[0], at[1]])",
             [f"{SEEDED_REPRO}[auto-no-lookups]", f"{SEEDED_LAW}[drafter-auto-T0.7-topk]"], note="seeded"),
    Mutation("seeded drafts drawn with other noise than the target's (the coupling broken; still exact)",
             "tgi_patch/engine/verification.py",
             "gumbel_scores(probs[coupled], seeds[coupled], gen_pos[coupled] + j)",
             "gumbel_scores(probs[coupled], seeds[coupled] + 1, gen_pos[coupled] + j)",
             ["tests/test_engine.py::test_a_seeded_draft_is_coupled_to_the_targets_draw"], note="seeded"),
    # ---- training lines up with drafting -------------------------------------------------------------
    Mutation("block training labels off by one (row k learns token a + k - 1)", "trainer/trainer.py",
             "labels = _gather_rows(input_ids, positions[..., 1:])",
             "labels = _gather_rows(input_ids, positions[..., :-1])",
             [f"{MEMORISE}[dflash]", f"{MEMORISE}[dfly]"], note="training"),
    Mutation("MTP step inputs off by one (step j reads x_{t+2+j})", "trainer/trainer.py",
             "(index + 1 + j).expand(ids.shape[0], -1)", "(index + 2 + j).expand(ids.shape[0], -1)",
             [f"{MEMORISE}[mtp]"], note="training"),
]


FAULTS = "tests/test_fault_isolation.py"
MUTATIONS += [
    Mutation("one request: a failed step's KV lengths not restored before its retry",
             "tgi_patch/engine/model_runner.py",
             "        self.pool.lengths.copy_(lengths[0])\n        self.pool.held[:] = lengths[1]\n", "",
             [f"{FAULTS}::test_a_fault_in_one_request_fails_it_alone[sampling-dfly]"], note="one request"),
    Mutation("one request: a temperature that is 0 as a float32 accepted", "tgi_patch/engine/request.py",
             "self.temperature >= FLOAT32_MIN_POSITIVE", "self.temperature > 0",
             [f"{FAULTS}::test_values_that_vanish_or_overflow_in_float32_are_refused"], note="one request"),
    Mutation("one request: the sampler passes +inf / NaN logits on", "tgi_patch/engine/sampling.py",
             "    return x.masked_fill(~(x > -float(\"inf\")).any(-1, keepdim=True), 0.0)\n",
             "    return logits.float()\n",
             [f"{FAULTS}::test_the_sampler_is_defined_for_any_logits_and_temperature"], note="one request"),
]


def copy_tree(dest: Path) -> None:
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, check=True,
                           capture_output=True).stdout.decode().split("\0")
    for rel in filter(None, files):
        src = ROOT / rel
        if not src.is_file():
            continue  # deleted in the working tree
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, target)


def import_tree(copy: Path) -> Path:
    """Lay the copy out as pyproject.toml's `package-dir` says (`angelspec_hf/tgi_patch` -> `tgi_patch/`, ...) with
    symlinks inside its `angelspec_hf/`, so that the copy, first on sys.path (PYTHONPATH, and the working directory
    that `python -m pytest` puts first), shadows the editable install of the real checkout."""
    config = tomllib.loads((copy / "pyproject.toml").read_text())
    package_dir = config["tool"]["setuptools"]["package-dir"]
    top = copy / package_dir["angelspec_hf"]
    for package, folder in package_dir.items():
        parts = package.split(".")
        if len(parts) == 2 and not (top / parts[1]).exists():
            (top / parts[1]).symlink_to(copy / folder, target_is_directory=True)
    return copy


def environment(site: Path) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(site)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    from angelspec_hf.prompts import data_dir  # the copy lives elsewhere: keep reading this checkout's prompt sets

    env.setdefault("ANGELSPEC_DATA", str(data_dir()))
    return env


def check_imports(python: str, copy: Path, env: dict) -> None:
    modules = ["angelspec_hf", "angelspec_hf.tgi_patch.engine", "angelspec_hf.tgi_patch.engine.core",
               "angelspec_hf.tgi_patch.engine.dcut", "angelspec_hf.policy.acceptance",
               "angelspec_hf.tgi_patch.engine.verification",
               "angelspec_hf.tgi_patch.engine.scheduler", "angelspec_hf.tgi_patch.engine.model_runner",
               "angelspec_hf.tgi_patch.engine.kernels.reference", "angelspec_hf.tgi_patch.engine.kernels.triton_kernels",
               "angelspec_hf.tgi_patch.engine.paged", "angelspec_hf.tgi_patch.engine.drafting",
               "angelspec_hf.modeling.candidate_generator"]
    code = "import importlib, os\n" + "".join(
        f"print(os.path.realpath(importlib.import_module({m!r}).__file__))\n" for m in modules)
    out = subprocess.run([python, "-c", code], cwd=copy, env=env, capture_output=True, text=True)
    if out.returncode:
        sys.exit(f"importing the scratch copy failed:\n{out.stderr[-3000:]}")
    paths = out.stdout.split()
    outside = [p for p in paths if not Path(p).is_relative_to(copy.resolve())]
    print("imports resolve inside the scratch copy:", ", ".join(modules), flush=True)
    if outside or len(paths) != len(modules):
        sys.exit(f"modules imported from outside the scratch copy {copy}: {outside or out.stdout}")


def run_tests(python: str, copy: Path, env: dict, tests: list[str], timeout: float):
    """Run pytest on `tests` in the copy: (exit status, failed node ids, output, seconds)."""
    start = time.perf_counter()
    cmd = [python, "-m", "pytest", "-q", "-rf", "-p", "no:cacheprovider", "-o", "console_output_style=classic", *tests]
    try:
        out = subprocess.run(cmd, cwd=copy, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return -1, [], "timed out", time.perf_counter() - start
    failed = re.findall(r"^FAILED (\S+)", out.stdout, flags=re.M)
    return out.returncode, failed, out.stdout + out.stderr, time.perf_counter() - start


def short(nodeid: str) -> str:
    return nodeid.replace("tests/", "").replace("test_sampling_is_exact_in_every_verify_mode_with_power", "engine law")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", help="run only mutations whose name contains this text (the sanity one always runs)")
    parser.add_argument("--keep", action="store_true", help="keep the scratch copy")
    parser.add_argument("--python", default=sys.executable, help="interpreter of the venv to test with")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per pytest run")
    parser.add_argument("--no-baseline", action="store_true", help="skip running the tests on the unmutated copy")
    args = parser.parse_args()

    mutations = [m for m in MUTATIONS if m.note == "sanity" or not args.only or args.only.lower() in m.name.lower()]
    scratch = Path(tempfile.mkdtemp(prefix="mutation_check_"))
    code = 0
    try:
        copy = scratch / "repo"
        copy_tree(copy)
        env = environment(import_tree(copy))
        check_imports(args.python, copy, env)
        print(f"scratch copy: {copy}", flush=True)

        # every mutation must match exactly once before anything runs; every named test file must exist
        problems = []
        for m in mutations:
            count = (copy / m.path).read_text().count(m.old)
            if count != 1:
                problems.append(f"{m.name}: {m.old!r} occurs {count} times in {m.path} (the code moved?)")
            for t in m.tests:
                if not (copy / t.split("::")[0]).is_file():
                    problems.append(f"{m.name}: test file {t.split('::')[0]} does not exist")
        if problems:
            print("cannot apply the mutations as written:\n  " + "\n  ".join(problems), file=sys.stderr)
            return 2

        if not args.no_baseline:
            tests = sorted({t for m in mutations if m.note != "sanity" for t in m.tests})
            rc, failed, output, seconds = run_tests(args.python, copy, env, tests, args.timeout)
            print(f"baseline (unmutated copy, {len(tests)} test selections): rc={rc} in {seconds:.0f}s", flush=True)
            if rc != 0:
                print(output[-6000:], file=sys.stderr)
                print("the unmutated copy does not pass the named tests: mutation results would mean nothing",
                      file=sys.stderr)
                return 2

        for m in mutations:
            path = copy / m.path
            original = path.read_text()
            path.write_text(original.replace(m.old, m.new, 1))
            try:
                rc, failed, output, seconds = run_tests(args.python, copy, env, m.tests, args.timeout)
            finally:
                path.write_text(original)
            if rc == 1 and failed:
                status = "yes"
            elif rc == 0:
                status = "NO (survived)"
            else:
                status = f"ERROR (pytest rc={rc})"
                print(output[-4000:], file=sys.stderr)
            if m.note == "sanity" and "mutation_check sanity mutation" not in output:
                status = "ERROR (sanity exception not seen: is the scratch copy imported?)"
            m.result = {"caught": status, "failed": failed, "seconds": seconds}
            print(f"  {m.name}: {status} ({seconds:.0f}s)", flush=True)
            if status != "yes":
                code = 1

        print()
        print("| mutation | file | test(s) run | caught | failing tests | s |")
        print("|---|---|---|---|---|---|")
        for m in mutations:
            r = m.result
            tag = "" if m.note == "exactness" else f" ({m.note})"
            print(f"| {m.name}{tag} | `{m.path}` | {'<br>'.join(short(t) for t in m.tests)} | {r['caught']} | "
                  f"{'<br>'.join(short(f) for f in r['failed']) or '-'} | {r['seconds']:.0f} |")
        survivors = [m.name for m in mutations if m.result["caught"] != "yes"]
        print()
        print(f"{len(mutations) - len(survivors)}/{len(mutations)} caught" +
              (f"; NOT caught: {survivors}" if survivors else ""))
    finally:
        if args.keep:
            print(f"kept {scratch}")
        else:
            shutil.rmtree(scratch, ignore_errors=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
