"""A local Hub-layout folder → the local Hugging Face cache, as if `snapshot_download(repo_id)` had fetched it, so
that `from_pretrained(repo_id)` finds it with the Hub unreachable (`HF_HUB_OFFLINE=1` / `local_files_only=True`).

huggingface_hub has readers for its cache (`scan_cache_dir`, `snapshot_download(local_files_only=True)`,
`try_to_load_from_cache`) but no public writer for files that did not come from the Hub, so this module writes its
layout (https://huggingface.co/docs/huggingface_hub/guides/manage-cache):

    <cache>/models--<org>--<name>/blobs/<blob id>          the files' contents, named as the Hub names them: the sha256
                                                            of the content for LFS files (binary, or ≥ 10 MB), git's
                                                            blob sha1 (of b"blob <size>\\0" + content) otherwise
    <cache>/models--<org>--<name>/snapshots/<rev>/<path>   relative symlinks to those blobs (copies where the file
                                                            system has no symlinks, as huggingface_hub does)
    <cache>/models--<org>--<name>/trees/<rev>.json         the file listing (huggingface_hub's format 1), against which
                                                            an offline `snapshot_download` checks that the snapshot is
                                                            complete
    <cache>/models--<org>--<name>/refs/main                <rev>, written last

`<rev>` is a content revision: the sha1 of the listing (path, blob id, size), so the same files give the same
revision and changed files a new one. It is not a Hub commit: these files were never pushed.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

LFS_MIN_SIZE = 10 * 1024 * 1024  # the Hub stores files from this size on (and every binary file) in LFS


def hub_cache_dir(cache_dir=None) -> Path:
    """`cache_dir`, else huggingface_hub's cache: `$HF_HUB_CACHE`, else `$HF_HOME/hub`, else
    `~/.cache/huggingface/hub` (huggingface_hub reads the variables when it is imported)."""
    from huggingface_hub import constants

    return Path(cache_dir if cache_dir is not None else constants.HF_HUB_CACHE).expanduser()


def repo_cache_folder(repo_id: str, cache_dir=None) -> Path:
    """`<cache>/models--<org>--<name>`."""
    from huggingface_hub.file_download import repo_folder_name

    return hub_cache_dir(cache_dir) / repo_folder_name(repo_id=repo_id, repo_type="model")


@dataclass(frozen=True)
class FileEntry:
    """One file of a folder, with the ids the Hub would give it."""

    path: str  # relative, "/"-separated
    size: int
    blob_id: str  # git blob sha1 of the file, or of its LFS pointer
    lfs_sha256: str | None  # set for LFS files

    @property
    def blob_name(self) -> str:
        return self.lfs_sha256 or self.blob_id


def _git_blob_sha1(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def _entry(path: str, data: bytes) -> FileEntry:
    if len(data) < LFS_MIN_SIZE and b"\0" not in data:
        return FileEntry(path, len(data), _git_blob_sha1(data), None)
    sha256 = hashlib.sha256(data).hexdigest()
    pointer = f"version https://git-lfs.github.com/spec/v1\noid sha256:{sha256}\nsize {len(data)}\n".encode()
    return FileEntry(path, len(data), _git_blob_sha1(pointer), sha256)


def folder_files(folder) -> dict[str, Path]:
    """The files a folder would be pushed with: every regular file below it except hidden ones and `__pycache__`."""
    folder = Path(folder)
    files = {}
    for file in sorted(folder.rglob("*")):
        rel = file.relative_to(folder)
        if file.is_file() and not any(part.startswith(".") or part == "__pycache__" for part in rel.parts):
            files[rel.as_posix()] = file
    return files


def folder_entries(folder) -> list[FileEntry]:
    return [_entry(rel, file.read_bytes()) for rel, file in folder_files(folder).items()]


def content_revision(entries: list[FileEntry]) -> str:
    """40 hex digits, a function of the files' paths and contents only."""
    listing = "".join(f"{e.path}\0{e.blob_id}\0{e.size}\n" for e in sorted(entries, key=lambda e: e.path))
    return hashlib.sha1(listing.encode()).hexdigest()


def _atomic_write(dest: Path, write) -> None:
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=dest.parent, prefix=f".{dest.name}.", suffix=".incomplete")
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
        os.replace(tmp, dest)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _link(blob: Path, dest: Path) -> None:
    dest.parent.mkdir(parents=True, exist_ok=True)
    if dest.is_symlink() or dest.exists():
        dest.unlink()
    try:
        os.symlink(os.path.relpath(blob, dest.parent), dest)
    except OSError:  # no symlinks here (e.g. Windows without developer mode): a copy, as huggingface_hub does
        shutil.copyfile(blob, dest)


def install_folder(folder, repo_id: str, cache_dir=None) -> tuple[Path, str, bool]:
    """Write `folder` into the HF cache as the `main` revision of model repo `repo_id`. Returns `(snapshot folder,
    revision, changed)`; `changed` is False when `refs/main` already pointed at these exact files. Idempotent, and
    safe to interrupt: blobs are written to temporary names then renamed, `refs/main` moves last."""
    folder = Path(folder)
    files = folder_files(folder)
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(f"{folder} has no config.json: not a model folder in Hub layout")
    repo = repo_cache_folder(repo_id, cache_dir)
    entries = []
    for rel, file in files.items():
        data = file.read_bytes()
        entry = _entry(rel, data)
        blob = repo / "blobs" / entry.blob_name
        if not (blob.is_file() and blob.stat().st_size == entry.size):
            _atomic_write(blob, lambda f, data=data: f.write(data))
        entries.append(entry)
    revision = content_revision(entries)
    ref = repo / "refs" / "main"
    changed = not (ref.is_file() and ref.read_text().strip() == revision)
    snapshot = repo / "snapshots" / revision
    for entry in entries:
        _link(repo / "blobs" / entry.blob_name, snapshot / entry.path)
    tree = {"format_version": 1, "files": {
        e.path: {"size": e.size, "blob_id": e.blob_id, **({"lfs_sha256": e.lfs_sha256, "lfs_size": e.size}
                                                          if e.lfs_sha256 else {})} for e in entries}}
    _atomic_write(repo / "trees" / f"{revision}.json", lambda f: f.write(json.dumps(tree, indent=1).encode()))
    _atomic_write(ref, lambda f: f.write(revision.encode()))  # huggingface_hub writes refs without a newline
    return snapshot, revision, changed
