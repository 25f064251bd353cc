"""Works when installed, not only when checked out: the shipped drafters resolve by Hub id from the local HF cache
(filled offline by `angelspec install-drafters`, read back with huggingface_hub's own readers), the checkout folder is
the fallback, an untrained fallback names its real reason, `generate`/`serve` fall back to n-gram lookup (not to an
untrained drafter) where no trained drafter fits, and the prompt data folder comes from `$ANGELSPEC_DATA`.
A checkout's tracked tree fits its size budget: the drafter weights are git blobs listed in `drafters/weights.json`,
written into the folders on demand."""

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
    NGRAM_LOOKUP_TOKENS,
    find_shipped,
    install_shipped,
    pick_drafter,
    shipped_or_untrained,
    shipped_repo_id,
    untrained_drafter,
)
from angelspec_hf.weights_store import (
    WeightFile,
    WeightsStoreError,
    materialise,
    read_manifest,
    store,
    write_manifest,
)
from helpers import tiny_chat_target, tiny_drafter, tiny_target

REPO = shipped_repo_id("dfly")
ROOT = SHIPPED_DIR.parent
TREE_BUDGET = 32 * 1024 * 1024  # bytes of tracked files: a GPU transfer (<= 64 MiB) carries the tree + a target part


def git(cwd, *args) -> str:
    return subprocess.run(["git", "-c", "user.name=test", "-c", "user.email=test@example.com", "-C", str(cwd), *args],
                          capture_output=True, text=True, check=True).stdout


def in_git_checkout() -> bool:
    return shutil.which("git") is not None and subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--git-dir"], capture_output=True).returncode == 0


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


def test_install_gives_each_drafter_the_checkouts_lookup_corpus(checkout, cache, monkeypatch, no_network):
    """The corpus a shipped drafter looks up in travels in its folder (`lookup_corpus.safetensors`, git-ignored in a
    checkout): `install-drafters` builds it from the replies beside `drafters/`, again only when they change, and a
    drafter loaded by Hub id (remote code included) has it; without replies nothing is written."""
    from angelspec_hf.policy.corpus import LOOKUP_CORPUS_FILE

    folder = checkout / f"{SHIPPED_PREFIX}dfly"
    install_shipped(checkout, families=("dfly",))
    assert not (folder / LOOKUP_CORPUS_FILE).exists()
    replies = shipped.replies_beside(checkout)
    replies.mkdir(parents=True)
    rows = [[5, 6, 7, 8], [5, 6, 9]]
    (replies / "code.jsonl").write_text("".join(json.dumps({"id": str(i), "response_ids": r}) + "\n"
                                                for i, r in enumerate(rows)))
    [(_, snapshot, revision, changed)] = install_shipped(checkout, families=("dfly",))
    assert changed and (snapshot / LOOKUP_CORPUS_FILE).read_bytes() == (folder / LOOKUP_CORPUS_FILE).read_bytes()
    written = (folder / LOOKUP_CORPUS_FILE).stat().st_mtime_ns
    assert install_shipped(checkout, families=("dfly",))[0][2:] == (revision, False)  # same replies: as it was
    assert (folder / LOOKUP_CORPUS_FILE).stat().st_mtime_ns == written
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)
    for drafter in (AutoModel.from_pretrained(REPO, trust_remote_code=True), AutoModel.from_pretrained(REPO)):
        assert [s.tolist() for s in drafter.lookup_corpus.sequences()] == rows
    with (replies / "code.jsonl").open("a") as f:  # new replies: a new corpus, a new revision
        f.write(json.dumps({"id": "2", "response_ids": [1, 2]}) + "\n")
    [(_, _, new_revision, changed)] = install_shipped(checkout, families=("dfly",))
    assert changed and new_revision != revision
    assert len(AutoModel.from_pretrained(REPO).lookup_corpus.sequences()) == 3


def test_a_checkout_that_cannot_be_written_still_gives_its_drafter(checkout, monkeypatch):
    """Writing the lookup corpus into a checkout's folder is a convenience: where it fails (a read-only checkout), the
    folder is still the drafter's."""
    def refuse(folder, regenerated=None):
        raise PermissionError(f"read-only: {folder}")

    monkeypatch.setattr(shipped, "write_shipped_corpus", refuse)
    assert shipped.checkout_drafter_path("dfly") == checkout / f"{SHIPPED_PREFIX}dfly"


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


def test_without_a_trained_drafter_the_commands_use_ngram_lookup_and_say_why(checkout, cache, target):
    """`--drafter dfly` where no trained DFly fits the target: n-gram lookup (needs no training), never an untrained
    drafter unless one is asked for by name."""
    assert pick_drafter("dfly", target).kind == "trained"  # the checkout's drafter fits the tiny target
    shutil.rmtree(checkout)
    choice = pick_drafter("dfly", target)
    assert choice.drafter is None and choice.kind == "lookup"
    assert "no trained dfly drafter" in choice.note and f"not in the HF cache {cache}" in choice.note
    assert f"{NGRAM_LOOKUP_TOKENS} tokens" in choice.note and "--drafter untrained:dfly" in choice.note
    for name, family in (("untrained", "DFlyDrafter"), ("untrained:mtp", "MTPDrafter")):
        choice = pick_drafter(name, target)
        assert choice.kind == "untrained" and type(choice.drafter).__name__ == family and "UNTRAINED" in choice.note
    assert pick_drafter("none", target).drafter is None
    with pytest.raises(ValueError, match="no drafter family 'eagle'"):
        pick_drafter("untrained:eagle", target)


def test_generate_on_a_target_without_a_trained_drafter_runs_ngram_lookup(tmp_path, cache, capsys, monkeypatch):
    from angelspec_hf.cli import main

    monkeypatch.setattr(shipped, "SHIPPED_DIR", tmp_path / "no-checkout")
    chat_target, tokenizer = tiny_chat_target()
    chat_target.save_pretrained(tmp_path / "target")
    tokenizer.save_pretrained(tmp_path / "target")
    assert main(["generate", "--target", str(tmp_path / "target"), "--drafter", "dfly", "--max-new-tokens", "12",
                 "--repeats", "1", "--threads", "1", "--linear-kernels", "stock"]) == 0
    out = capsys.readouterr().out
    assert "NOTE: no trained dfly drafter for this target" in out and "UNTRAINED" not in out
    assert "n-gram lookup, up to 10 tokens per round" in out and "identical to plain : yes (1/1 runs)" in out


def test_the_batched_engine_runs_ngram_lookup_without_a_drafter(target):
    """What `serve` runs where no trained drafter fits: the engine with n-gram lookups only, the target's own tokens."""
    from angelspec_hf.tgi_patch.engine import SpeculativeEngine, generate_batch

    prompts = [[5, 6, 7, 5, 6, 7, 5, 6], [9, 10, 11, 9, 10]]
    engine = SpeculativeEngine(target, None, lookup_tokens=NGRAM_LOOKUP_TOKENS, max_batch_size=2)
    outs = generate_batch(target, None, prompts, max_new_tokens=12, engine=engine)
    for prompt, out in zip(prompts, outs):
        plain = target.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, pad_token_id=0)
        assert out == plain[0, len(prompt):].tolist()
    assert engine.totals["lookup_rows"] > 0  # lookups were verified, not only plain steps


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


@pytest.mark.skipif(not in_git_checkout(), reason="not a git checkout (or no git): no tracked tree to measure")
def test_the_tracked_tree_fits_its_budget():
    """What a GPU machine call carries (docs/contributing.md): the tracked files as they are in the working tree."""
    tracked = [f for f in git(ROOT, "ls-files", "-z").split("\0") if f]
    sizes = {f: (ROOT / f).lstat().st_size for f in tracked if os.path.lexists(ROOT / f)}  # deleted ones: not sent
    assert len(sizes) > 100 and "pyproject.toml" in sizes and "drafters/weights.json" in sizes
    assert not [f for f in tracked if f.startswith("drafters/") and f.endswith(".safetensors")], \
        "drafter weights are tracked: keep them as git blobs (python -m angelspec_hf.weights_store store)"
    biggest = sorted(sizes.items(), key=lambda kv: -kv[1])[:8]
    assert sum(sizes.values()) <= TREE_BUDGET, f"tracked tree {sum(sizes.values())} bytes > {TREE_BUDGET}: {biggest}"


@pytest.mark.skipif(not in_git_checkout(), reason="not a git checkout (or no git): the weights are git blobs")
def test_the_manifest_materialises_the_shipped_weights(tmp_path):
    entries = read_manifest(SHIPPED_DIR)
    assert [e.path for e in entries] == [f"{SHIPPED_PREFIX}{f}/model.safetensors" for f in ("dflash", "dfly", "mtp")]
    written = materialise(SHIPPED_DIR, dest=tmp_path)
    assert [path for path, _ in written] == [tmp_path / e.path for e in entries]
    for entry in entries:
        data = (tmp_path / entry.path).read_bytes()
        assert (len(data), hashlib.sha256(data).hexdigest()) == (entry.size, entry.sha256)
        assert git(ROOT, "hash-object", str(tmp_path / entry.path)).strip() == entry.blob
        assert json.loads(data[8 : 8 + int.from_bytes(data[:8], "little")])  # a safetensors header
    assert materialise(SHIPPED_DIR, dest=tmp_path) == []  # all there and verified: nothing rewritten
    assert not [p for p in tmp_path.rglob("*") if p.name.startswith(".")]  # no temporaries left


@pytest.fixture
def weights_repo(tmp_path):
    """A git repository with `drafters/d/` whose weights were committed, stored in the manifest, then untracked."""
    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    repo = tmp_path / "repo"
    (repo / "drafters" / "d").mkdir(parents=True)
    (repo / "drafters" / "d" / "config.json").write_text("{}\n")
    (repo / "drafters" / "d" / "model.safetensors").write_bytes(os.urandom(5000))
    git(repo, "init", "-q")
    git(repo, "add", "-A")
    git(repo, "commit", "-qm", "weights")
    return repo


def test_weights_are_stored_as_blobs_and_materialised(weights_repo):
    drafters = weights_repo / "drafters"
    weights = drafters / "d" / "model.safetensors"
    data = weights.read_bytes()
    [entry] = store([drafters / "d"])
    blob = git(weights_repo, "rev-parse", "HEAD:drafters/d/model.safetensors").strip()
    assert entry == WeightFile("d/model.safetensors", blob, len(data), hashlib.sha256(data).hexdigest())
    assert read_manifest(drafters) == [entry]
    git(weights_repo, "rm", "-q", "--cached", "drafters/d/model.safetensors")
    git(weights_repo, "add", "drafters/weights.json")
    git(weights_repo, "commit", "-qm", "weights out of the tree")
    assert "drafters/d/model.safetensors" not in git(weights_repo, "ls-files")
    with pytest.raises(WeightsStoreError, match="HEAD has no .safetensors file under drafters/d/: commit"):
        store([drafters / "d"])
    with pytest.raises(WeightsStoreError, match="no-such-rev is not a commit in HEAD's history"):
        store([drafters / "d"], rev="no-such-rev")
    weights.unlink()
    [(path, note)] = materialise(drafters)
    assert path == weights and weights.read_bytes() == data and entry.blob[:12] in note
    umask = os.umask(0)
    os.umask(umask)
    assert weights.stat().st_mode & 0o777 == 0o666 & ~umask  # as a plain write leaves it, not mkstemp's 0600
    assert materialise(drafters) == []
    # a file that differs (e.g. retrained, not yet stored): left alone by lookups; replaced, and kept aside, on install
    weights.write_bytes(b"retrained")
    assert materialise(drafters, verify=False) == [] and weights.read_bytes() == b"retrained"
    [(_, note)] = materialise(drafters)
    kept = weights.with_name(f".model.safetensors.{hashlib.sha256(b'retrained').hexdigest()[:12]}")
    assert weights.read_bytes() == data and kept.read_bytes() == b"retrained" and kept.name in note


def test_materialising_says_what_is_wrong(weights_repo, tmp_path, monkeypatch):
    drafters = weights_repo / "drafters"
    store([drafters / "d"])
    git(weights_repo, "rm", "-q", "--cached", "drafters/d/model.safetensors")
    git(weights_repo, "add", "drafters/weights.json")
    git(weights_repo, "commit", "-qm", "weights out of the tree")
    [entry] = read_manifest(drafters)
    # a shallow clone lacks the commit holding the blob
    shallow = tmp_path / "shallow"
    git(tmp_path, "clone", "-q", "--depth", "1", f"file://{weights_repo}", str(shallow))
    with pytest.raises(WeightsStoreError, match=f"blob {entry.blob} of d/model.safetensors .*git fetch --unshallow"):
        materialise(shallow / "drafters")
    # a copy outside any git checkout
    copy = tmp_path / "copy"
    shutil.copytree(drafters, copy, ignore=shutil.ignore_patterns("*.safetensors"))
    with pytest.raises(WeightsStoreError, match="is not in a git checkout"):
        materialise(copy)
    # a manifest that does not match its blob: refused, nothing written
    write_manifest(drafters, [WeightFile(entry.path, entry.blob, entry.size, "0" * 64)])
    weights = drafters / "d" / "model.safetensors"
    data = weights.read_bytes()
    with pytest.raises(WeightsStoreError, match="the manifest is wrong"):
        materialise(drafters)  # the file there differs from the (wrong) manifest: it stays as it was
    assert weights.read_bytes() == data
    assert sorted(p.name for p in weights.parent.iterdir()) == ["config.json", "model.safetensors"]
    weights.unlink()
    with pytest.raises(WeightsStoreError, match="the manifest is wrong"):
        materialise(drafters)
    assert sorted(p.name for p in weights.parent.iterdir()) == ["config.json"]
    # no git at all
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    with pytest.raises(WeightsStoreError, match="`git` is not installed"):
        materialise(drafters)


def test_a_checkout_without_its_weights_writes_them_or_says_how(checkout, cache, tmp_path):
    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    folder = checkout / f"{SHIPPED_PREFIX}dfly"
    weights = folder / "model.safetensors"
    data = weights.read_bytes()
    git(tmp_path, "init", "-q")
    git(tmp_path, "add", "drafters")
    git(tmp_path, "commit", "-qm", "drafter")
    store([folder])
    weights.unlink()
    found = find_shipped("dfly")  # the checkout's folder, its weights written from git
    assert found.source == "checkout" and weights.read_bytes() == data
    weights.unlink()
    install_shipped(checkout, families=("dfly",))  # what `angelspec install-drafters` (and `make`) run
    assert weights.read_bytes() == data
    # git cannot give them (no checkout any more): the cache serves; without it, the reason and the command
    shutil.rmtree(tmp_path / ".git")
    weights.unlink()
    with pytest.raises(WeightsStoreError, match="not in a git checkout.*angelspec install-drafters --from"):
        shipped.checkout_drafter_path("dfly")
    assert find_shipped("dfly").source == "hf-cache"
    shutil.rmtree(cache)
    cache.mkdir()
    why = []
    assert find_shipped("dfly", why=why) is None
    assert "the checkout folder lacks its weights" in why[0] and "not in a git checkout" in why[0]
