"""`scripts/gpu/stage.py`: the payload is cut into calls that fit the device's per-call limit beside the tree, pieces
are checked by sha256, a missing or corrupt piece is reported by call (and a cold machine named as such), and a
complete stage rebuilds every item byte for byte. No model, no wheels: synthetic files stand in for them. The GPU runs
themselves (`scripts/gpu/playbook.sh`) are rehearsed as docs/gpu.md says, not here."""

import hashlib
import importlib.util
import json
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("gpu_stage", ROOT / "scripts" / "gpu" / "stage.py")
stage = importlib.util.module_from_spec(spec)
spec.loader.exec_module(stage)


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
