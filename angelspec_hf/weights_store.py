"""Drafter weights kept in the repository's git history instead of its working tree.

The tracked tree stays under its size budget (docs/contributing.md) while the shipped drafters' weights remain part
of the repository: `drafters/weights.json` (the manifest) lists, for each weight file, its path relative to
`drafters/`, the git blob that holds its bytes (committed once, reachable from main's history), its size and its
sha256. The files themselves are git-ignored; `materialise` writes them from the blobs with `git cat-file blob`.

    python -m angelspec_hf.weights_store materialise [FOLDER]        # default: this checkout's drafters/
    python -m angelspec_hf.weights_store store [--rev REV] FOLDER...  # record weights committed at REV (default HEAD)

Shipping new weights (see docs/contributing.md): commit them (`git add -f`, they are ignored) in one commit, run
`store` on their folders, then `git rm --cached` them and commit the updated manifest in the next commit."""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

MANIFEST = "weights.json"
WEIGHT_SUFFIX = ".safetensors"  # the files `store` records: every safetensors file of a drafter folder
_CHUNK = 1 << 20


class WeightsStoreError(RuntimeError):
    """A weight file cannot be written from, or recorded in, git: the message says why and what fixes it."""


@dataclass(frozen=True)
class WeightFile:
    """One manifest entry: `path` relative to the manifest's folder ("/"-separated), `blob` the git blob id."""

    path: str
    blob: str
    size: int
    sha256: str


CHECKOUT_DRAFTERS = Path(__file__).resolve().parent.parent / "drafters"  # a checkout's; a wheel does not carry it


def default_folder() -> Path:
    return CHECKOUT_DRAFTERS


def read_manifest(folder=None) -> list[WeightFile]:
    """The entries of `folder/weights.json` (default: this checkout's `drafters/`); [] when it has none."""
    path = Path(folder if folder is not None else default_folder()) / MANIFEST
    if not path.is_file():
        return []
    return [WeightFile(**entry) for entry in json.loads(path.read_text())["files"]]


def write_manifest(folder, entries: list[WeightFile]) -> Path:
    path = Path(folder) / MANIFEST
    doc = {"about": "drafter weights kept as git blobs (git-ignored files); written by "
                    "`python -m angelspec_hf.weights_store store`, materialised by `angelspec install-drafters`",
           "files": [asdict(e) for e in sorted(entries, key=lambda e: e.path)]}
    path.write_text(json.dumps(doc, indent=1) + "\n")
    return path


def _git(folder: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    try:
        run = subprocess.run(["git", "-C", str(folder), *args], capture_output=True, text=True)
    except FileNotFoundError:
        raise WeightsStoreError("`git` is not installed: the drafter weights are stored as git blobs "
                                f"({folder / MANIFEST}); install git and retry") from None
    if check and run.returncode != 0:
        raise WeightsStoreError(f"`git {' '.join(args)}` failed in {folder}: {run.stderr.strip()}")
    return run


def _check_checkout(folder: Path) -> None:
    run = _git(folder, "rev-parse", "--git-dir", check=False)
    if run.returncode != 0:
        raise WeightsStoreError(f"{folder} is not in a git checkout ({run.stderr.strip()}): the drafter weights "
                                f"listed in {folder / MANIFEST} are git blobs; use a `git clone` of the repository")


def _check_blob(folder: Path, entry: WeightFile) -> None:
    if _git(folder, "cat-file", "-e", f"{entry.blob}^{{blob}}", check=False).returncode == 0:
        return
    shallow = _git(folder, "rev-parse", "--is-shallow-repository", check=False).stdout.strip() == "true"
    fix = ("this is a shallow clone: run `git fetch --unshallow`" if shallow else
           "fetch main's full history (`git fetch origin`), where the commit that added it lives")
    raise WeightsStoreError(f"git blob {entry.blob} of {entry.path} is not in this repository: {fix}")


def sha256_file(path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def write_blob(folder, entry: WeightFile, dest) -> Path:
    """`git cat-file blob` of `entry` streamed into `dest` (a temporary file renamed into place once its size and
    sha256 match the entry's). `folder` is any folder of the checkout that holds the blob."""
    folder, dest = Path(folder), Path(dest)
    _check_checkout(folder)
    _check_blob(folder, entry)
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=dest.parent, prefix=f".{dest.name}.", suffix=".incomplete")
    try:
        digest, size = hashlib.sha256(), 0
        with os.fdopen(fd, "wb") as out:
            proc = subprocess.Popen(["git", "-C", str(folder), "cat-file", "blob", entry.blob],
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE)
            while chunk := proc.stdout.read(_CHUNK):
                out.write(chunk)
                digest.update(chunk)
                size += len(chunk)
            error = proc.stderr.read().decode(errors="replace").strip()
            if proc.wait() != 0:
                raise WeightsStoreError(f"`git cat-file blob {entry.blob}` failed in {folder}: {error}")
        if (size, digest.hexdigest()) != (entry.size, entry.sha256):
            raise WeightsStoreError(f"git blob {entry.blob} gives {size} bytes with sha256 {digest.hexdigest()}, "
                                    f"but the manifest records {entry.size} bytes with sha256 {entry.sha256} for "
                                    f"{entry.path}: the manifest is wrong; rerun `store` on the commit holding it")
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # as a plain write would leave it (mkstemp's file is private)
        os.replace(tmp, dest)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return dest


def materialise(folder=None, names=None, verify: bool = True, dest=None) -> list[tuple[Path, str]]:
    """Write the weight files listed in `folder/weights.json` (default: this checkout's `drafters/`) that are missing
    from `dest` (default: `folder`), from their git blobs in `folder`'s repository; with `verify`, also those whose
    size or sha256 differ from the manifest's (the file there is kept beside it as the hidden, git-ignored
    `.<name>.<its sha256[:12]>`, in case it was newly trained weights not yet stored). `names`: only the entries
    under these sub-folders. Returns `(path, what was done)` per file written. Raises `WeightsStoreError` when a file
    is needed and git cannot give it."""
    folder = Path(folder if folder is not None else default_folder())
    root = Path(dest) if dest is not None else folder
    done = []
    for entry in read_manifest(folder):
        if names is not None and entry.path.split("/")[0] not in names:
            continue
        dest = root / entry.path
        note = f"written from git blob {entry.blob[:12]}"
        if dest.is_file():
            if not verify:
                continue
            actual = sha256_file(dest) if dest.stat().st_size == entry.size else None
            if actual == entry.sha256:
                continue
            actual = actual or sha256_file(dest)
            kept = dest.with_name(f".{dest.name}.{actual[:12]}")
            os.replace(dest, kept)
            try:
                write_blob(folder, entry, dest)
            except BaseException:
                os.replace(kept, dest)  # git could not give it: leave the file that was there
                raise
            note += f" (the file there differed from the manifest; kept as {kept.name})"
        else:
            write_blob(folder, entry, dest)
        done.append((dest, note))
    return done


def store(folders, rev: str = "HEAD") -> list[WeightFile]:
    """Record in the manifest beside each of `folders` (drafter folders, e.g. `drafters/<name>`; the manifest is
    their parent's `weights.json`) the safetensors files committed under them at `rev`, which must be in the
    history of HEAD (so the blobs reach every clone of main). Entries of other paths are kept. Returns the
    entries recorded."""
    recorded = []
    for folder in folders:
        folder = Path(folder).resolve()
        parent = folder.parent
        _check_checkout(parent)
        if _git(parent, "merge-base", "--is-ancestor", rev, "HEAD", check=False).returncode != 0:
            raise WeightsStoreError(f"{rev} is not a commit in HEAD's history: commit the weights on this branch "
                                    "first, so their blobs stay reachable from it")
        listing = _git(parent, "ls-tree", "-r", "-l", "--full-name", rev, "--", f"{folder.name}/").stdout
        prefix = _git(parent, "rev-parse", "--show-prefix").stdout.strip()
        found = []
        for line in listing.splitlines():
            meta, path = line.split("\t", 1)
            _, kind, blob, size = meta.split()
            if kind == "blob" and path.endswith(WEIGHT_SUFFIX):
                digest = hashlib.sha256()
                proc = subprocess.Popen(["git", "-C", str(parent), "cat-file", "blob", blob], stdout=subprocess.PIPE)
                while chunk := proc.stdout.read(_CHUNK):
                    digest.update(chunk)
                if proc.wait() != 0:
                    raise WeightsStoreError(f"`git cat-file blob {blob}` ({path}) failed in {parent}")
                found.append(WeightFile(path[len(prefix):], blob, int(size), digest.hexdigest()))
        if not found:
            raise WeightsStoreError(f"{rev} has no {WEIGHT_SUFFIX} file under {prefix}{folder.name}/: commit the "
                                    "weights first (`git add -f`, they are git-ignored)")
        keep = [e for e in read_manifest(parent) if e.path not in {f.path for f in found}]
        write_manifest(parent, keep + found)
        recorded += found
    return recorded


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m angelspec_hf.weights_store",
                                     description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    mat = sub.add_parser("materialise", help="write the manifest's missing or differing weight files from git")
    mat.add_argument("folder", nargs="?", default=None, help="folder holding weights.json (default: drafters/)")
    st = sub.add_parser("store", help="record the weights committed at --rev under these folders in the manifest")
    st.add_argument("folders", nargs="+", help="drafter folders, e.g. drafters/smollm2-135m-instruct-dfly")
    st.add_argument("--rev", default="HEAD", help="the commit holding the weights (default: HEAD)")
    args = parser.parse_args(argv)
    try:
        if args.command == "materialise":
            written = materialise(args.folder)
            for path, note in written:
                print(f"{path}: {note}")
            manifest = Path(args.folder or default_folder()) / MANIFEST
            print(f"{len(written)} written; every other file matches {manifest}")
        else:
            for entry in store(args.folders, args.rev):
                print(f"recorded {entry.path}: blob {entry.blob}, {entry.size} bytes, sha256 {entry.sha256}")
            print("next: `git rm --cached` these weight files and commit the updated weights.json")
    except WeightsStoreError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
