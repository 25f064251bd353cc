"""Works when installed, not only when checked out: the shipped drafters resolve by Hub id from the local HF cache
(filled offline by `angelspec install-drafters`, read back with huggingface_hub's own readers), the checkout folder is
the fallback, an untrained fallback names its real reason, and the prompt data folder comes from `$ANGELSPEC_DATA`."""

import hashlib
import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from huggingface_hub import scan_cache_dir, snapshot_download, try_to_load_from_cache
from huggingface_hub.errors import IncompleteSnapshotError
from transformers import AutoModel

from angelspec_hf import prompts, shipped
from angelspec_hf.shipped import (
    SHIPPED_DIR,
    SHIPPED_PREFIX,
    find_shipped,
    install_shipped,
    shipped_or_untrained,
    shipped_repo_id,
    untrained_drafter,
)
from helpers import tiny_drafter, tiny_target

REPO = shipped_repo_id("dfly")


@pytest.fixture
def checkout(tmp_path, target, monkeypatch):
    """A checkout's `drafters/` holding a tiny DFly drafter for the tiny target; `shipped.SHIPPED_DIR` points at it."""
    root = tmp_path / "drafters"
    drafter = tiny_drafter("dfly", target)
    drafter.save_pretrained(root / f"{SHIPPED_PREFIX}dfly")
    (root / f"{SHIPPED_PREFIX}dfly" / "README.md").write_text("# a tiny DFly drafter\n")
    monkeypatch.setattr(shipped, "SHIPPED_DIR", root)
    return root


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """An empty HF hub cache, made huggingface_hub's default as `HF_HUB_CACHE=<it>` at start-up would."""
    path = tmp_path / "hub"
    path.mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(path))
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(path))
    return path


@pytest.fixture
def no_network(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError(f"network access attempted: {args}")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)


def test_install_writes_huggingface_hubs_cache_layout(checkout, cache):
    folder = checkout / f"{SHIPPED_PREFIX}dfly"
    [(repo_id, snapshot, revision, changed)] = install_shipped(checkout, families=("dfly",))
    assert (repo_id, changed) == (REPO, True) and snapshot == cache / "models--angelspec-hf--smollm2-135m-instruct-dfly" \
        / "snapshots" / revision
    # huggingface_hub's own readers see it
    [repo] = scan_cache_dir(cache).repos
    assert (repo.repo_id, repo.repo_type, repo.nb_files) == (REPO, "model", len(list(folder.iterdir())))
    [rev] = repo.revisions
    assert rev.commit_hash == revision and rev.refs == {"main"}
    assert snapshot_download(REPO, local_files_only=True) == str(snapshot)
    assert try_to_load_from_cache(REPO, "config.json") == str(snapshot / "config.json")
    # blobs are named as the Hub names them: sha256 for LFS (binary) files, git's blob sha1 for text files
    for name in ("config.json", "model.safetensors", "README.md"):
        link, data = snapshot / name, (folder / name).read_bytes()
        assert link.is_symlink() and not os.path.isabs(os.readlink(link)) and link.read_bytes() == data
        blob = Path(os.readlink(link)).name
        if name == "model.safetensors":
            assert blob == hashlib.sha256(data).hexdigest()
        elif shutil.which("git"):
            assert blob == subprocess.run(["git", "hash-object", str(folder / name)], capture_output=True, text=True,
                                          check=True).stdout.strip()
    assert (snapshot.parents[1] / "refs" / "main").read_text() == revision
    # the same files again: the same revision, nothing changed
    assert install_shipped(checkout, families=("dfly",))[0][2:] == (revision, False)


def test_incomplete_snapshot_is_detected(checkout, cache):
    """The file listing written beside the snapshot is huggingface_hub's: it refuses a snapshot that lost a file."""
    [(_, snapshot, _, _)] = install_shipped(checkout, families=("dfly",))
    (snapshot / "model.safetensors").unlink()
    with pytest.raises(IncompleteSnapshotError):
        snapshot_download(REPO, local_files_only=True)
    shutil.rmtree(checkout)
    why = []
    assert find_shipped("dfly", why=why) is None and "incomplete" in why[0] and "model.safetensors" in why[0]


def test_drafter_loads_by_hub_id_offline_and_equals_the_folder(checkout, cache, target, monkeypatch, no_network):
    install_shipped(checkout, families=("dfly",))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)
    by_id = AutoModel.from_pretrained(REPO, trust_remote_code=True)
    folder = AutoModel.from_pretrained(checkout / f"{SHIPPED_PREFIX}dfly")
    assert type(by_id) is type(folder) and by_id.config.to_dict() | {"_name_or_path": ""} == \
        folder.config.to_dict() | {"_name_or_path": ""}
    assert by_id.state_dict().keys() == folder.state_dict().keys()
    assert all(torch.equal(by_id.state_dict()[k], v) for k, v in folder.state_dict().items())


def test_resolution_prefers_the_cache_and_says_which(checkout, cache, target, no_network):
    # no cache yet: the checkout's folder, and the note says how to install it
    found = find_shipped("dfly")
    assert found.source == "checkout" and found.folder == checkout / f"{SHIPPED_PREFIX}dfly"
    assert f"{REPO} is not in the HF cache {cache}" in found.note and "angelspec install-drafters" in found.note
    # installed: by Hub id from the cache, even with the checkout's identical folder there
    [(_, snapshot, revision, _)] = install_shipped(checkout, families=("dfly",))
    why = []
    drafter, trained = shipped_or_untrained("dfly", target, why=why)
    assert trained and drafter.config._name_or_path == REPO
    assert why == [f"the shipped dfly drafter {REPO} from the HF cache (revision {revision[:12]}, {snapshot})"]
    assert shipped.checkout_drafter_path("dfly") == checkout / f"{SHIPPED_PREFIX}dfly"  # what scripts that edit use
    # a retrained drafter in the checkout, not yet installed: the checkout's, and why
    (checkout / f"{SHIPPED_PREFIX}dfly" / "README.md").write_text("# retrained\n")
    found = find_shipped("dfly")
    assert found.source == "checkout" and "holds other files than this folder" in found.note
    # an installed package (no checkout folder): the cache
    shutil.rmtree(checkout)
    assert find_shipped("dfly").source == "hf-cache"


def test_untrained_fallback_names_the_real_reason(checkout, cache, target):
    shutil.rmtree(checkout)
    why = []
    drafter, trained = shipped_or_untrained("dfly", target, why=why)
    assert not trained and type(drafter).__name__ == "DFlyDrafter"
    [reason] = why
    assert REPO in reason and f"not in the HF cache {cache}" in reason
    assert str(checkout / f"{SHIPPED_PREFIX}dfly") in reason and "angelspec install-drafters --from" in reason


def test_a_drafter_for_another_target_falls_back_with_the_mismatch(tmp_path, cache, target, monkeypatch):
    other = tmp_path / "other"
    tiny_drafter("dfly", tiny_target(vocab_size=101)).save_pretrained(other / f"{SHIPPED_PREFIX}dfly")
    install_shipped(other, families=("dfly",))
    monkeypatch.setattr(shipped, "SHIPPED_DIR", tmp_path / "no-checkout")
    why = []
    _, trained = shipped_or_untrained("dfly", target, why=why)
    assert not trained and why[0].startswith(f"the shipped dfly drafter ({REPO} from the HF cache")
    assert "does not fit this target" in why[0] and "101" in why[0]


def test_a_named_folder_comes_first_and_a_wrong_one_falls_back_with_its_reason(checkout, tmp_path, cache, target):
    # the Space's own copy of a drafter: used in place of the shipped one, and its mismatch reported like theirs
    mine = tmp_path / "space" / "dfly"
    tiny_drafter("dfly", target, seed=7).save_pretrained(mine)
    why = []
    drafter, trained = shipped_or_untrained("dfly", target, why=why, folder=mine)
    assert trained and why == [f"the shipped dfly drafter from {mine}"]
    assert torch.equal(drafter.fc.weight, tiny_drafter("dfly", target, seed=7).fc.weight)
    wrong = tmp_path / "space" / "wrong"
    tiny_drafter("dfly", tiny_target(vocab_size=101)).save_pretrained(wrong)
    why = []
    drafter, trained = shipped_or_untrained("dfly", target, why=why, folder=wrong)
    assert not trained and f"({'from ' + str(wrong)}) does not fit this target" in why[0]
    # an untrained fallback is the same drafter every time, and leaves the caller's random stream alone
    torch.manual_seed(3)
    expected = torch.rand(4)
    torch.manual_seed(3)
    again = untrained_drafter("dfly", target)
    assert torch.equal(torch.rand(4), expected)
    assert all(torch.equal(a, b) for a, b in zip(drafter.state_dict().values(), again.state_dict().values()))


def test_install_refuses_a_folder_without_the_drafters(tmp_path, cache, capsys):
    from angelspec_hf.cli import main

    with pytest.raises(FileNotFoundError, match="no shipped drafter folder for"):
        install_shipped(tmp_path, families=("dfly",))
    assert main(["install-drafters", "--from", str(tmp_path / "nowhere")]) == 1
    assert "nowhere does not exist (an installed package carries no drafters/): pass --from" in capsys.readouterr().out
    assert not any(cache.iterdir())


def test_cli_installs_into_the_cache_named_by_HF_HUB_CACHE(checkout, tmp_path):
    """A fresh process, so huggingface_hub reads `HF_HUB_CACHE` at import as it does for users."""
    hub = tmp_path / "env-hub"
    env = dict(os.environ, HF_HUB_CACHE=str(hub), HF_HUB_OFFLINE="1")
    run = subprocess.run([sys.executable, "-m", "angelspec_hf.cli", "install-drafters", "--from", str(checkout),
                          "--families", "dfly"], capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert f"HF cache: {hub}" in run.stdout and f"{REPO}: revision" in run.stdout and "(installed)" in run.stdout
    assert [r.repo_id for r in scan_cache_dir(hub).repos] == [REPO]


@pytest.mark.skipif(not (SHIPPED_DIR / f"{SHIPPED_PREFIX}dfly").is_dir(), reason="not a checkout")
def test_the_real_shipped_folders_install(tmp_path):
    installed = install_shipped(SHIPPED_DIR, cache_dir=tmp_path)
    assert [r for r, *_ in installed] == [shipped_repo_id(f) for f in ("mtp", "dflash", "dfly")]
    assert sorted(r.repo_id for r in scan_cache_dir(tmp_path).repos) == sorted(r for r, *_ in installed)
    for repo_id, snapshot, _, _ in installed:
        weights = SHIPPED_DIR / repo_id.split("/")[1] / "model.safetensors"
        assert Path(os.readlink(snapshot / "model.safetensors")).name == hashlib.sha256(
            weights.read_bytes()).hexdigest()
        assert json.loads((snapshot / "config.json").read_text())["auto_map"]


def test_data_dir_honours_ANGELSPEC_DATA(tmp_path, monkeypatch):
    (tmp_path / "mt_bench").mkdir()
    (tmp_path / "mt_bench" / "question.jsonl").write_text(json.dumps({"turns": ["Hello?", "And?"]}) + "\n")
    monkeypatch.setenv("ANGELSPEC_DATA", str(tmp_path))
    assert prompts.data_dir() == tmp_path and prompts.load_eval_prompts("mt_bench") == ["Hello?"]
    with pytest.raises(FileNotFoundError, match=r"gsm8k/test.jsonl is missing .*ANGELSPEC_DATA="):
        prompts.load_eval_prompts("gsm8k")
    monkeypatch.setenv("ANGELSPEC_DATA", str(tmp_path / "nowhere"))
    with pytest.raises(FileNotFoundError, match=r"no prompt data folder: \$ANGELSPEC_DATA is .*nowhere.*Set "
                                                r"ANGELSPEC_DATA to"):
        prompts.load_eval_prompts("mt_bench")
    monkeypatch.delenv("ANGELSPEC_DATA")
    monkeypatch.setattr(prompts, "__file__", str(tmp_path / "site-packages" / "angelspec_hf" / "prompts.py"))
    with pytest.raises(FileNotFoundError, match=r"\$ANGELSPEC_DATA is not set and the default beside a checkout"):
        prompts.data_dir()
