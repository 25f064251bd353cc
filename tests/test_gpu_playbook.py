"""`scripts/gpu/stage.py`: the payload is cut into calls that fit the device's per-call limit beside the tree, pieces
are checked by sha256, a missing or corrupt piece is reported by call (and a cold machine named as such), and a
complete stage rebuilds every item byte for byte; a previous GPU period's result travels and lands where the
playbook's train part looks for it. `scripts/gpu/results.py`: the training record continues across periods, the
shipped drafters come back in at most 8 files and `receive` rebuilds them. No model, no wheels: synthetic files stand
in for them. Last, marked `real_model`: the playbook's train part rehearsed on the CPU with the real target, drafters
and prompts (smoke sizes), three families, then a second period that starts from the first's returned result."""

import hashlib
import importlib.util
import json
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _load(name, path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


stage = _load("gpu_stage", ROOT / "scripts" / "gpu" / "stage.py")
results = _load("gpu_results", ROOT / "scripts" / "gpu" / "results.py")


@pytest.mark.parametrize("sizes, capacity", [([10, 25, 7, 0, 31], 20), ([5], 100), ([64, 64], 64), ([1, 2, 3], 1)])
def test_pieces_cover_every_item_in_the_fewest_calls_that_fit(sizes, capacity):
    items = [(f"item{i}", size) for i, size in enumerate(sizes)]
    pieces = stage.plan_pieces(items, capacity)
    total = sum(sizes)
    calls = max(1, -(-total // capacity))
    assert max(p["call"] for p in pieces) == calls
    for k in range(1, calls + 1):
        assert sum(p["size"] for p in pieces if p["call"] == k) <= capacity
    for name, size in items:  # each item: contiguous pieces, in order, covering it once
        mine = [p for p in pieces if p["item"] == name]
        assert [p["index"] for p in mine] == list(range(len(mine)))
        assert [p["offset"] for p in mine] == [sum(q["size"] for q in mine[:i]) for i in range(len(mine))]
        assert sum(p["size"] for p in mine) == size
    assert [p["call"] for p in pieces] == sorted(p["call"] for p in pieces)
    with pytest.raises(stage.StageError, match="no room"):
        stage.plan_pieces(items, 0)


@pytest.fixture
def payload(tmp_path):
    """A payload of three synthetic items (one bigger than a call) cut for 40 KiB calls, and a machine-side tree."""
    rng = random.Random(0)
    sources = []
    for name, size in (("a-1.0-py3-none-any.whl", 30_000), ("big.bin", 100_000), ("small.bin", 5_000)):
        path = tmp_path / "src" / name
        path.parent.mkdir(exist_ok=True)
        path.write_bytes(rng.randbytes(size))
        sources.append({"name": name, "kind": "blob", "path": path})
    manifest = stage.write_payload(sources, tmp_path / "tree" / stage.PAYLOAD, 40 * 1024)
    return tmp_path, manifest, sources


def carry(tmp_path, call):
    """What a device call with carry ["gpu_payload/call<k>"] leaves in the machine's tree."""
    src = tmp_path / "tree" / stage.PAYLOAD / f"call{call}"
    dest = tmp_path / "machine" / stage.PAYLOAD / f"call{call}"
    shutil.copytree(src, dest)


def test_the_payload_folders_hold_the_calls_and_the_manifest(payload):
    tmp_path, manifest, sources = payload
    out = tmp_path / "tree" / stage.PAYLOAD
    assert manifest["calls"] == 4  # 135,000 bytes in calls of <= 40,960
    assert json.loads((out / "manifest.json").read_text()) == manifest
    for k in range(1, 5):
        folder = out / f"call{k}"
        assert json.loads((folder / "manifest.json").read_text())["pack_id"] == manifest["pack_id"]
        assert stage.folder_bytes(folder) - (folder / "manifest.json").stat().st_size <= 40 * 1024
        for piece in (p for p in manifest["pieces"] if p["call"] == k):
            data = (folder / piece["file"]).read_bytes()
            assert len(data) == piece["size"] and hashlib.sha256(data).hexdigest() == piece["sha256"]
    for item, src in zip(manifest["items"], sources):
        assert item["sha256"] == hashlib.sha256(Path(src["path"]).read_bytes()).hexdigest()
    # the plan: the staging calls, the playbook's call last, then the fp32 bench on the warm machine
    subprocess.run(["git", "init", "-q", str(tmp_path / "tree")], check=True)
    text, ok = stage.plan_text(manifest, out, repo=tmp_path / "tree", limit=10 * 1024 * 1024)
    assert ok and "call 4/4" in text and "command: bash scripts/gpu/playbook.sh" in text
    assert text.index("command: bash scripts/gpu/playbook.sh") < text.index(stage.FP32_BENCH_COMMAND)


def test_unpack_reports_missing_calls_then_rebuilds_every_item(payload):
    tmp_path, manifest, sources = payload
    machine, st = tmp_path / "machine", tmp_path / "stage"
    carry(tmp_path, 1)
    got, arrived = stage.collect(machine, st)
    assert arrived == ["call1"] and not list((machine / stage.PAYLOAD).glob("call*"))  # moved out of the tree
    present, missing = stage.check_pieces(got, st)
    assert {p["call"] for p in present} == {1} and {p["call"] for p in missing} == {2, 3, 4}
    report = stage.missing_report(got, missing, arrived)
    assert 'carry ["gpu_payload/call2"]' in report and "went cold" not in report
    for k in (2, 3, 4):
        carry(tmp_path, k)
    got, arrived = stage.collect(machine, st)
    present, missing = stage.check_pieces(got, st)
    assert not missing and len(present) == len(manifest["pieces"])
    rebuilt = stage.assemble(got, st)
    for src in sources:
        assert rebuilt[src["name"]].read_bytes() == Path(src["path"]).read_bytes()


def test_a_cold_machine_and_a_corrupt_piece_are_reported(payload):
    tmp_path, manifest, _ = payload
    machine, st = tmp_path / "machine", tmp_path / "stage"
    carry(tmp_path, 3)  # a fresh machine: calls 1 and 2 were staged on the one that went back
    got, arrived = stage.collect(machine, st)
    _, missing = stage.check_pieces(got, st)
    report = stage.missing_report(got, missing, arrived)
    assert "went cold" in report and 'carry ["gpu_payload/call1"]' in report
    victim = next(p for p in manifest["pieces"] if p["call"] == 3)
    path = st / "pieces" / victim["file"]
    path.write_bytes(b"x" + path.read_bytes()[1:])
    _, missing = stage.check_pieces(got, st)
    assert victim in missing and not path.exists()  # removed, to be carried again


def test_a_stage_refuses_pieces_of_another_pack(payload):
    tmp_path, manifest, sources = payload
    machine, st = tmp_path / "machine", tmp_path / "stage"
    carry(tmp_path, 1)
    stage.collect(machine, st)
    Path(sources[2]["path"]).write_bytes(b"changed")
    stage.write_payload(sources, tmp_path / "tree" / stage.PAYLOAD, 40 * 1024)
    carry(tmp_path, 2)
    with pytest.raises(stage.StageError, match="another pack|holds pieces of pack"):
        stage.collect(machine, st)


def test_unpack_cli_exits_3_while_incomplete_and_refuses_a_checkout(payload):
    tmp_path, _, _ = payload
    machine = tmp_path / "machine"
    carry(tmp_path, 2)
    script = str(ROOT / "scripts" / "gpu" / "stage.py")
    run = subprocess.run([sys.executable, script, "unpack", "--stage", str(tmp_path / "st"), "--site",
                          str(tmp_path / "site")], cwd=machine, capture_output=True, text=True)
    assert run.returncode == stage.EXIT_INCOMPLETE, run.stdout + run.stderr
    assert "missing: call 1" in run.stdout and "went cold" in run.stdout
    (machine / ".git").mkdir()
    run = subprocess.run([sys.executable, script, "unpack", "--stage", str(tmp_path / "st")], cwd=machine,
                         capture_output=True, text=True)
    assert run.returncode == 2 and "git checkout" in run.stdout


def test_package_links_follow_pyproject(tmp_path):
    """The machine's tree imports without an install: `angelspec_hf/<sub>` links to each folder pyproject maps."""
    (tmp_path / "angelspec_hf").mkdir()
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    made = stage.link_packages(tmp_path)
    assert "angelspec_hf/modeling -> ../modeling" in made and "angelspec_hf/trainer -> ../trainer" in made
    assert (tmp_path / "angelspec_hf" / "modeling").readlink() == Path("..") / "modeling"
    assert stage.link_packages(tmp_path) == []  # idempotent


def test_the_payload_folder_is_ignored():
    """It must never travel as part of the tree (only through `carry`) nor be committed."""
    run = subprocess.run(["git", "check-ignore", "-q", "gpu_payload/call1/x"], cwd=ROOT)
    if run.returncode == 128:
        pytest.skip("not a git checkout")
    assert run.returncode == 0


# ------------------------------------------------------------------------------------ a previous period's result
def fake_result(folder, family, size=3000, seed=0):
    """A `<family>-gpu/` folder as `receive` writes it: weights, config and a one-period record."""
    rng = random.Random(seed)
    out = folder / f"{family}-gpu"
    out.mkdir(parents=True)
    (out / "model.safetensors").write_bytes(rng.randbytes(size))
    config = {"model_type": f"angelspec_{family}"}
    shipped = json.loads((ROOT / results.SHIPPED[family] / "config.json").read_text())
    if shipped.get("held_out_tau_ends"):  # a run continued from the shipped drafter adds its own end
        config["held_out_tau_ends"] = [*shipped["held_out_tau_ends"],
                                       {"blocks": shipped["training_blocks"] + 640, "tau": 2.5}]
    (out / "config.json").write_text(json.dumps(config))
    state = {"global_step": 10, "log_history": [{"step": 10, "blocks": 640, "tau/held_out": 2.5}]}
    record = results.make_record(family, state, None, init=results.SHIPPED[family], source="final", device="GPU",
                                 batch=4, anchors=16, max_steps=10, seed=1, wall_seconds=9)
    (out / results.RECORD).write_text(json.dumps(record))
    return out


def test_init_from_travels_and_lands_where_the_train_part_looks(tmp_path):
    previous = tmp_path / "period-1"
    for i, family in enumerate(("dfly", "mtp")):
        fake_result(previous, family, seed=i)
    (previous / "returned").mkdir()
    (previous / "returned" / "playbook.log").write_text("log")
    sources = stage.init_sources(previous)
    assert {s["dest"].split("/")[1] for s in sources} == {"dfly-gpu", "mtp-gpu"}  # nothing else travels
    assert all(s["kind"] == "init" and s["dest"].startswith("init/") for s in sources)
    machine = tmp_path / "machine"
    (machine / "scripts").mkdir(parents=True)
    shutil.copy(ROOT / "pyproject.toml", machine / "pyproject.toml")
    shutil.copy(ROOT / "scripts" / "regenerate_gpu.py", machine / "scripts" / "regenerate_gpu.py")
    (machine / "angelspec_hf").mkdir()
    stage.write_payload(sources, machine / stage.PAYLOAD, 1 << 20)
    run = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu" / "stage.py"), "unpack", "--stage",
                          str(tmp_path / "st"), "--site", str(tmp_path / "site")], cwd=machine, capture_output=True,
                         text=True)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "previous GPU result" in run.stdout
    for family in ("dfly", "mtp"):
        for path in (previous / f"{family}-gpu").iterdir():
            assert (tmp_path / "st" / "init" / f"{family}-gpu" / path.name).read_bytes() == path.read_bytes()
    assert results.run_period(tmp_path / "st" / "init", ["dfly", "dflash", "mtp"]) == 2
    with pytest.raises(stage.StageError, match="no dfly-gpu/"):
        stage.init_sources(previous / "returned")
    # a later period that trained MTP only: MTP continues from it, DFly from the period before
    later = tmp_path / "period-2"
    mtp = fake_result(later, "mtp", seed=5)
    record = json.loads((mtp / results.RECORD).read_text())
    record["periods"].append(record["periods"][0] | {"period": 2})
    (mtp / results.RECORD).write_text(json.dumps(record))
    for folders in ([previous, later], [later, previous]):
        picked = {s["dest"].split("/")[1]: Path(s["path"]).parent for s in stage.init_sources(folders)}
        assert picked == {"dfly-gpu": previous / "dfly-gpu", "mtp-gpu": later / "mtp-gpu"}


def test_the_record_continues_across_periods():
    history = [{"step": 0, "blocks": 0, "tau/held_out": 2.36, "first/held_out": 0.5},
               {"step": 10, "loss": 3.0, "blocks": 1200}, {"step": 20, "loss": 2.5, "blocks": 2400},
               {"step": 20, "blocks": 2400, "tau/held_out": 2.41, "first/held_out": 0.52},
               {"step": 20, "train_runtime": 61.0}]
    state = {"global_step": 20, "log_history": history,
             "stateful_callbacks": {"BlocksSeen": {"attributes": {"count": 2400}}}}
    first = results.make_record("dfly", state, None, init="drafters/smollm2-135m-instruct-dfly", source="final",
                                device="H200", batch=8, anchors=16, max_steps=600, seed=1, wall_seconds=120)
    p = first["periods"][0]
    assert (p["period"], p["steps"], p["blocks"], p["nominal_blocks"], p["sequences"]) == (1, 20, 2400, 2560, 160)
    assert p["stopped"] == "max_train_seconds" and p["train_seconds"] == 61.0
    assert [(q["step"], q["tau"]) for q in p["tau_held_out"]] == [(0, 2.36), (20, 2.41)]
    assert (p["loss_first"], p["loss_last"]) == (3.0, 2.5)
    second = results.make_record("dfly", state, first, init="previous GPU result", source="checkpoint-20",
                                 device="H200", batch=8, anchors=16, max_steps=600, seed=2, wall_seconds=120)
    assert [q["period"] for q in second["periods"]] == [1, 2]
    assert second["shipped_start"] == "drafters/smollm2-135m-instruct-dfly"
    assert second["cumulative"] == {"periods": 2, "steps": 40, "sequences": 320, "blocks": 4800,
                                    "train_seconds": 122.0}
    assert "killed" in second["periods"][1]["stopped"]
    dflash = results.make_record("dflash", state, None, init="x", source="final", device="H200", batch=8,
                                 anchors=16, max_steps=600, seed=1, wall_seconds=1, stop_at_step=25)
    assert dflash["periods"][0]["equal_budget_with_dfly"] == {"dfly_steps": 25, "matched": False}
    assert "NOT at equal budget" in results.summary_line(dflash)
    mtp = results.make_record("mtp", state, None, init="x", source="final", device="H200", batch=8, anchors=None,
                              max_steps=20, seed=1, wall_seconds=1)
    assert mtp["periods"][0]["blocks"] == mtp["cumulative"]["blocks"] > 0  # MTP counts its blocks as well
    assert mtp["periods"][0]["stopped"] == "max_steps"
    assert p["schedule_steps"] == 600  # not fitted: the schedule is max_steps long
    fitted = dict(state, stateful_callbacks=state["stateful_callbacks"] | {
        "FittedSchedule": {"attributes": {"steps": 20, "step_seconds": 2.5}}})
    fit = results.make_record("dfly", fitted, None, init="x", source="final", device="H200", batch=8, anchors=16,
                              max_steps=600, seed=1, wall_seconds=1)["periods"][0]
    assert fit["schedule_steps"] == 20 and "fitted to the time budget" in fit["stopped"]


def test_step_limit_stops_at_the_step_and_saves():
    from transformers import TrainerControl, TrainerState

    from angelspec_hf.trainer.run import StepLimit

    limit, state, control = StepLimit(3), TrainerState(), TrainerControl()
    for step in (1, 2):
        state.global_step = step
        limit.on_step_end(None, state, control)
        assert not control.should_training_stop
    state.global_step = 3
    limit.on_step_end(None, state, control)
    assert control.should_training_stop and control.should_save
    from angelspec_hf.trainer.arguments import DrafterTrainingArguments

    with pytest.raises(ValueError, match="stop_at_step"):
        DrafterTrainingArguments(output_dir="unused", stop_at_step=0)


def test_the_returned_files_stay_within_eight_and_receive_rebuilds_them(tmp_path, capsys):
    ship, out = tmp_path / "ship", tmp_path / "out"
    out.mkdir()
    for name in ("playbook.log", "gpu_tests.txt", "bench.log", "bench.tar.gz", "train.log"):
        (out / name).write_text(name)
    for i, family in enumerate(results.FAMILIES):
        fake_result(ship, family, size=40_000, seed=i)  # ~121 kB of tar.gz: random bytes do not compress
    size = results.write_pieces(ship, out, piece_bytes=1 << 30)[0].stat().st_size
    # 3 slots left beside the 5 logs: pieces of a third fit; of a quarter, they would not, so the larger size is
    # used; when even that does not fit, the playbook says so
    three, four, five = -(-size // 3), -(-size // 4), -(-size // 5)
    for piece, larger, count in ((three, three, 3), (four, three, 3), (five, four, 5)):
        pieces = results.write_pieces(ship, out, piece_bytes=piece, max_files=8, max_piece_bytes=larger)
        assert len(pieces) == count and len(list(out.glob("train.tar*"))) == count  # the old pieces are gone
        assert ("WARNING: 10 files" in capsys.readouterr().out) == (count == 5)
    pieces = results.write_pieces(ship, out, piece_bytes=three, max_files=8)
    assert len(list(out.iterdir())) == 8 and all(p.stat().st_size <= three for p in pieces)
    assert results.fold_logs(out) == []  # 8 files: nothing to fold
    (out / "extra.txt").write_text("x")
    assert results.fold_logs(out) == ["gpu_tests.txt", "bench.log", "train.log"]
    assert len(list(out.iterdir())) == 7 and (out / "logs.tar.gz").is_file()

    final, text = results.receive(out, tmp_path / "received")
    assert final.name == "period-1"
    for family in results.FAMILIES:
        for path in (ship / f"{family}-gpu").iterdir():
            assert (final / f"{family}-gpu" / path.name).read_bytes() == path.read_bytes()
    assert sorted(p.name for p in (final / "returned").iterdir()) == ["bench.tar.gz", "extra.txt", "logs.tar.gz",
                                                                     "playbook.log"]
    assert f"stage.py pack --init-from {final.as_posix()}" in text
    assert "--full-vocab" in text and "--sets sharegpt,alpaca" in text
    # every family's curve starts from the blocks its shipped drafter had seen (its config's training_blocks), and
    # DFly's, whose config records the CPU rounds' ends, is fitted through them
    assert results.shipped_blocks() == {"dfly": 8_648_078, "dflash": 460_800, "mtp": 489_897}
    assert "--blocks-before 8648078 --fit-ends --out" in text
    assert "--blocks-before 460800 --out" in text and "--blocks-before 489897 --sets" in text
    # a returned DFly whose config records no earlier ends is drawn without the ends fit
    (final / "dfly-gpu" / "config.json").write_text(json.dumps({"model_type": "angelspec_dfly"}))
    records = {"dfly": results.read_record(final / "dfly-gpu")}
    assert "--blocks-before 8648078 --out" in results.next_steps(final, records, results.shipped_blocks())
    with pytest.raises(results.ResultError, match="exists"):
        results.receive(out, tmp_path / "received")
    pieces[1].unlink()
    with pytest.raises(results.ResultError, match=r"missing \['train.tar.gz.001'\]"):
        results.receive(out, tmp_path / "again")


def test_the_playbook_refuses_bad_families_and_warns_when_the_budgets_overrun(tmp_path):
    env = os.environ | {"OUT": str(tmp_path / "out"), "PLAYBOOK_WORK": str(tmp_path / "work"),
                        "PLAYBOOK_STAGE": str(tmp_path / "st"), "PLAYBOOK_PYTHON": sys.executable}
    script = str(ROOT / "scripts" / "gpu" / "playbook.sh")
    run = subprocess.run(["bash", script], env=env | {"PLAYBOOK_TRAIN_FAMILIES": "dfly eagle"}, capture_output=True,
                         text=True)
    assert run.returncode == 2 and "unknown family 'eagle'" in run.stdout
    run = subprocess.run(["bash", script], env=env | {"PLAYBOOK_TRAIN_SHARES": "dfly:2"}, capture_output=True,
                         text=True)
    assert run.returncode == 2 and "FAMILY=WEIGHT" in run.stdout
    # every part with three families does not fit a 540 s call: said loudly, with the train-only command line (the
    # run then stops at unpack, which refuses a git checkout)
    run = subprocess.run(["bash", script], env=env | {"PLAYBOOK_TRAIN_FAMILIES": "mtp,dflash dfly"},
                         capture_output=True, text=True)
    assert "WARNING" in run.stdout and "725s" in run.stdout  # 60 + 60 + 45 + (50 + 60) + 3 x 150
    assert 'PLAYBOOK_PARTS=train PLAYBOOK_TRAIN_FAMILIES="dfly dflash mtp" PLAYBOOK_BUDGET_TRAIN=450' in run.stdout
    assert stage.TRAIN_COMMAND.startswith('PLAYBOOK_PARTS=train PLAYBOOK_TRAIN_FAMILIES="dfly dflash mtp" '
                                          "PLAYBOOK_BUDGET_TRAIN=450 ")  # what `plan` prints
    assert stage.FP32_BENCH_COMMAND.startswith("PLAYBOOK_PARTS=bench PLAYBOOK_BENCH_DTYPES=fp32 ")
    run = subprocess.run(["bash", script], env=env, capture_output=True, text=True)
    # the default call fits: training (DFly, 240 s), then the tests and the bf16 bench
    assert "WARNING" not in run.stdout and "515s planned" in run.stdout  # 60 + 240 + 60 + 45 + 50 + 60
    assert "parts train,tests,bench" in run.stdout


# ------------------------------------------------------------------------------ the train part, rehearsed on CPU
def _playbook(repo, tmp_path, out, families, **extra):
    env = os.environ | {
        "OUT": str(out), "PLAYBOOK_PYTHON": sys.executable, "PLAYBOOK_DEVICE": "cpu", "PLAYBOOK_SMOKE": "1",
        "PLAYBOOK_PARTS": "train", "PLAYBOOK_TRAIN_FAMILIES": families, "PLAYBOOK_STAGE": str(tmp_path / "stage"),
        "PLAYBOOK_SITE": str(tmp_path / "site"), "PLAYBOOK_WORK": str(tmp_path / "work"),
        "PLAYBOOK_BUDGET_TRAIN": "1500", "PLAYBOOK_TRAIN_RESERVE": "300", "PLAYBOOK_CALL_LIMIT": "100000"} | extra
    run = subprocess.run(["nice", "-n", "5", "bash", "scripts/gpu/playbook.sh"], cwd=repo, env=env,
                         capture_output=True, text=True, timeout=1800)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    return run.stdout


@pytest.mark.real_model
def test_the_train_part_trains_three_families_then_resumes_from_the_returned_result(tmp_path):
    """docs/gpu.md's CPU rehearsal of the train part: the tree a call receives (`copy-tree`), a payload of the real
    drafter weights and prompt archives staged by the playbook's own `unpack`, then DFly, MTP and DFlash at smoke sizes;
    `receive` of what $OUT holds; a second period of DFlash and MTP started from that result on the warm stage."""
    from angelspec_hf.prompts import data_dir

    if not all((data_dir() / rel).is_file() for rel in stage.EVAL_FILES + stage.TRAIN_FILES):
        pytest.skip("the shared prompt files are not here")
    repo = tmp_path / "repo"
    run = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu" / "stage.py"), "copy-tree", str(repo)],
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr
    cache = tmp_path / "cache"
    sources = [{"name": "eval_data.tar.gz", "kind": "data", "path": stage.eval_data_archive(cache / "eval.tar.gz")},
               {"name": "train_prompts.tar.xz", "kind": "data", "path": stage.train_prompts_archive(cache, preset=0)}]
    for path, rel in stage.drafter_weights():
        sources.append({"name": rel.replace("/", "__"), "kind": "drafter", "dest": f"drafters/{rel}", "path": path})
    stage.write_payload(sources, repo / stage.PAYLOAD, 1 << 30)

    out1 = tmp_path / "out1"
    log = _playbook(repo, tmp_path, out1, "dfly mtp dflash")
    names = sorted(p.name for p in out1.iterdir())
    assert len(names) <= 8 and "train.tar.gz.000" in names, names
    assert all(p.stat().st_size <= 16 << 20 for p in out1.iterdir())
    assert log.index("train dfly: start") < log.index("train dflash: start") < log.index("train mtp: start")
    first, text = results.receive(out1, tmp_path / "received")
    records = {f: json.loads((first / f"{f}-gpu" / results.RECORD).read_text()) for f in results.FAMILIES}
    for family, record in records.items():
        p = record["periods"][0]
        assert (p["period"], p["steps"], p["seed"], p["init"]) == (1, 2, 1, results.SHIPPED[family])
        assert p["tau_held_out"] and p["tau_held_out"][0]["step"] == 0  # held-out τ logged from the start
        assert (first / f"{family}-gpu" / "trainer_state.json").is_file()
    assert records["dflash"]["periods"][0]["equal_budget_with_dfly"] == {"dfly_steps": 2, "matched": True}
    assert "--stop_at_step 2 --max_steps 2 --fit_schedule_to_time false" in records["dflash"]["periods"][0]["train_args"]
    assert records["dflash"]["periods"][0]["schedule_steps"] == records["dfly"]["periods"][0]["schedule_steps"] == 2
    assert "--fit_schedule_to_time true" in records["dfly"]["periods"][0]["train_args"]
    assert records["dfly"]["periods"][0]["blocks"] > 0 and records["mtp"]["periods"][0]["blocks"] > 0
    assert json.loads((first / "dflash-gpu" / "config.json").read_text()).get("draft_vocab_size") is None
    assert json.loads((first / "mtp-gpu" / "config.json").read_text())["layout"] == "eagle3"

    out2 = tmp_path / "out2"
    log = _playbook(repo, tmp_path, out2, "dflash,mtp", PLAYBOOK_INIT_DIR=str(first))
    assert "no DFly result in this run" in log
    second, text = results.receive(out2, tmp_path / "received")
    assert second.name == "period-2" and not (second / "dfly-gpu").exists()
    records = {f: json.loads((second / f"{f}-gpu" / results.RECORD).read_text()) for f in ("dflash", "mtp")}
    for family, record in records.items():
        assert [p["period"] for p in record["periods"]] == [1, 2]
        assert record["periods"][1]["init"].startswith("previous GPU result")
        assert record["periods"][1]["seed"] == 2
        assert record["cumulative"]["steps"] == 4
    assert "equal_budget_with_dfly" not in records["dflash"]["periods"][1]  # no DFly in this call to match
    assert records["dflash"]["cumulative"]["blocks"] == 2 * records["dflash"]["periods"][0]["blocks"]
    assert '--earlier "GPU period 1:' in text
    assert f"--init-from {second.as_posix()} {first.as_posix()}" in text  # DFly continues from period 1
