"""The drafters shipped with the project for the embedded SmolLM2-135M-Instruct target, found the way users get
drafters: by Hub id (`SHIPPED_ORG/smollm2-135m-instruct-{mtp,dflash,dfly}`) from the local Hugging Face cache, never
from the network. `angelspec install-drafters` puts them there from their Hub-layout folders (`drafters/` of a
checkout: fp16 safetensors, config, modeling code, model card). A checkout also works without the cache: its
`drafters/` folder is used when the cache lacks a drafter or holds other files than the checkout's, and the caller is
told which was used. `python -m angelspec_hf.ship RUN DEST` writes a training run's final weights into that layout.

A checkout keeps the weights as git blobs, not as tracked files: `drafters/weights.json` lists them and
`angelspec_hf.weights_store` writes them from git when they are missing (`angelspec install-drafters` does, and so do
the functions here on first use)."""

from __future__ import annotations

import functools
import hashlib
import os
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path

from angelspec_hf.hub_cache import content_revision, folder_entries, hub_cache_dir, install_folder
from angelspec_hf.weights_store import CHECKOUT_DRAFTERS, WeightsStoreError, materialise

SHIPPED_ORG = "angelspec-hf"  # the Hub organisation the shipped drafters are published under
SHIPPED_PREFIX = "smollm2-135m-instruct-"
SHIPPED_FAMILIES = ("mtp", "dflash", "dfly")
SHIPPED_DIR = CHECKOUT_DRAFTERS  # a checkout's drafters/; a wheel does not carry it


def shipped_repo_id(family: str) -> str:
    """The Hub id of the shipped drafter of `family`, e.g. `angelspec-hf/smollm2-135m-instruct-dfly`."""
    if family not in SHIPPED_FAMILIES:
        raise ValueError(f"no drafter of family {family!r} ships; choose one of {SHIPPED_FAMILIES}")
    return f"{SHIPPED_ORG}/{SHIPPED_PREFIX}{family}"


@dataclass(frozen=True)
class ShippedDrafter:
    """Where the shipped drafter of `family` was found: `source` is "hf-cache" (`folder` is the snapshot),
    "checkout" (`folder` is `drafters/<name>`) or "folder" (one the caller named); `note` says which, and why the
    checkout when not the cache."""

    family: str
    repo_id: str
    source: str
    folder: Path
    note: str
    cache_dir: Path | None = None

    def load(self, **kwargs):
        """The drafter: by Hub id, offline, from the cache; or from the checkout's folder."""
        import angelspec_hf

        if self.source == "hf-cache":
            return angelspec_hf.load_drafter(self.repo_id, cache_dir=str(self.cache_dir), local_files_only=True,
                                             **kwargs)
        return angelspec_hf.load_drafter(str(self.folder), **kwargs)


def _cached_snapshot(repo_id: str, cache: Path) -> tuple[Path | None, str]:
    """`(snapshot folder, "")` when huggingface_hub resolves `repo_id` offline from `cache`, else `(None, why)`."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import IncompleteSnapshotError, LocalEntryNotFoundError

    try:
        return Path(snapshot_download(repo_id, cache_dir=str(cache), local_files_only=True)), ""
    except IncompleteSnapshotError as error:
        return None, f"{repo_id} is incomplete in the HF cache {cache} ({error})"
    except LocalEntryNotFoundError:
        return None, f"{repo_id} is not in the HF cache {cache}"


def find_shipped(family: str, cache_dir=None, why: list | None = None) -> ShippedDrafter | None:
    """The shipped drafter of `family`: by Hub id from the HF cache (`cache_dir`, default huggingface_hub's), else
    from a checkout's `drafters/`. In a checkout whose folder holds other files than the cache's snapshot (a retrained
    or re-exported drafter not yet installed), the checkout's is used. None when neither has it; the reason is then
    appended to `why`, with the command that fixes it."""
    repo_id, cache = shipped_repo_id(family), hub_cache_dir(cache_dir)
    snapshot, cache_reason = _cached_snapshot(repo_id, cache)
    if snapshot is not None and not (snapshot / "config.json").is_file():
        snapshot, cache_reason = None, f"the HF cache's snapshot of {repo_id} has no config.json ({snapshot})"
    try:
        local, local_reason = checkout_drafter_path(family), ""
    except WeightsStoreError as error:
        local, local_reason = None, str(error)
    if snapshot is not None:
        revision = snapshot.name
        if local is None or content_revision(folder_entries(local)) == revision:
            return ShippedDrafter(family, repo_id, "hf-cache", snapshot,
                                  f"{repo_id} from the HF cache (revision {revision[:12]}, {snapshot})", cache)
        cache_reason = f"the HF cache's {repo_id} (revision {revision[:12]}) holds other files than this folder"
    if local is not None:
        return ShippedDrafter(family, repo_id, "checkout", local,
                              f"{local} in this checkout ({cache_reason}; `angelspec install-drafters` installs it)")
    if why is not None:
        checkout = (f"the checkout folder lacks its weights: {local_reason}" if local_reason else
                    f"there is no checkout folder {SHIPPED_DIR / (SHIPPED_PREFIX + family)}")
        why.append(f"no shipped {family} drafter: {cache_reason}, and {checkout}; run `angelspec install-drafters "
                   f"--from <a checkout's drafters/ folder>`")
    return None


def checkout_drafter_path(family: str) -> Path | None:
    """The checkout's `drafters/` folder of `family`, or None (an installed package). Edit the shipped drafters here:
    the files of a cache snapshot are symlinks into blobs named by their content. Weights listed in
    `drafters/weights.json` but missing from the folder are written from git first; `WeightsStoreError` (naming
    `angelspec install-drafters --from drafters`) when git cannot give them."""
    path = SHIPPED_DIR / f"{SHIPPED_PREFIX}{family}"
    if not (path / "config.json").is_file():
        return None
    try:
        materialise(SHIPPED_DIR, names=[path.name], verify=False)
    except WeightsStoreError as error:
        raise WeightsStoreError(f"{path} lacks its weights and they cannot be written from git: {error} (then run "
                                f"`angelspec install-drafters --from {SHIPPED_DIR}`)") from error
    try:
        write_shipped_corpus(path)
    except OSError:  # a read-only checkout: `trained_drafter` reads the replies instead (`shipped_lookup_corpus`)
        pass
    return path


def shipped_drafter_path(family: str, cache_dir=None) -> Path | None:
    """Folder of the shipped drafter of `family` to read (the cache's snapshot or the checkout's folder, see
    `find_shipped`), or None when there is none. To edit the shipped files, use `checkout_drafter_path`."""
    found = find_shipped(family, cache_dir)
    return found.folder if found else None


def untrained_drafter(family: str, target, seed: int = 0, **overrides):
    """A fresh drafter of `family` for `target` with random weights, the same ones for the same `seed` (the global
    RNG is left as it was), on the target's device in its dtype."""
    import torch

    from angelspec_hf.modeling import DRAFTERS

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        drafter = DRAFTERS[family][1].from_target(target, **overrides)
    return drafter.to(target.device, target.dtype).eval()


def drafter_for_target(name_or_path: str, target):
    """A drafter named by folder or Hub id, ready to run beside `target`: on its device, in its dtype (as the shipped
    ones are), so a drafter stored in fp16 runs, like its target, in fp32 on a CPU - where fp16 matmuls are slow and
    only fp32 linears are prepacked (`--linear-kernels prepacked`) - and in bf16 beside a bf16 target on a GPU."""
    import angelspec_hf

    return angelspec_hf.load_drafter(name_or_path, device=target.device, dtype=target.dtype)


def corpus_source(regenerated) -> str:
    """What a corpus built from the regenerated replies in `regenerated` records as its source: the folder's name and
    a sha256 over its files, so a corpus written before the replies changed is known to be stale."""
    digest = hashlib.sha256()
    for path in sorted(Path(regenerated).glob("*.jsonl*")):
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return f"regenerated replies {Path(regenerated).name} sha256:{digest.hexdigest()}"


def replies_beside(drafters) -> Path:
    """Where a checkout whose `drafters/` folder is `drafters` keeps the embedded target's regenerated replies."""
    return Path(drafters).parent / "data" / "regenerated" / SHIPPED_PREFIX.rstrip("-")


SHIPPED_CORPUS = replies_beside(CHECKOUT_DRAFTERS)  # this checkout's


def write_shipped_corpus(folder, regenerated=None) -> bool:
    """Write the lookup corpus of the replies in `regenerated` (default: the checkout's beside `folder`,
    `replies_beside`) into the drafter folder `folder`
    (`lookup_corpus.safetensors`, which `from_pretrained` attaches as `drafter.lookup_corpus`) unless the one there
    was built from the same files. A checkout keeps the replies, not the corpus file (git-ignored, as the weights
    are): `install-drafters` and `checkout_drafter_path` write it. Returns whether it was written; False also when
    `regenerated` is absent (an installed package)."""
    from safetensors import safe_open

    from angelspec_hf.policy.corpus import LOOKUP_CORPUS_FILE, CorpusIndex

    path = Path(folder) / LOOKUP_CORPUS_FILE
    regenerated = replies_beside(Path(folder).parent) if regenerated is None else Path(regenerated)
    if not any(regenerated.glob("*.jsonl*")):
        return False
    source = corpus_source(regenerated)
    if path.is_file():
        try:
            with safe_open(str(path), framework="numpy") as f:
                if (f.metadata() or {}).get("source") == source:
                    return False
        except Exception:  # unreadable: written again below  # noqa: BLE001
            pass
    handle, partial = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".partial", dir=path.parent)
    os.close(handle)
    try:  # a name of its own: processes building it at once (`pytest -n`) each rename a whole file into place
        CorpusIndex.from_regenerated(regenerated).save(partial, source=source)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(partial, 0o666 & ~umask)
        os.replace(partial, path)
    finally:
        if os.path.exists(partial):
            os.unlink(partial)
    return True


@functools.cache
def shipped_lookup_corpus():
    """The corpus a shipped drafter loaded from a folder without one looks up in (`drafter.lookup_corpus`, used in
    rounds of the `generate()` hook when the drafter's `lookup_tokens` is on): the embedded target's own replies to
    the TRAIN prompt sets, the data the drafters were trained on (a checkout's `data/regenerated/smollm2-135m-instruct/`),
    as a `angelspec_hf.policy.CorpusIndex`, read once per process. None where that folder is absent (an installed
    package does not carry it)."""
    if not SHIPPED_CORPUS.is_dir():
        return None
    from angelspec_hf.policy import CorpusIndex

    return CorpusIndex.from_regenerated(SHIPPED_CORPUS)


def trained_drafter(family: str, target, dtype=None, why: list | None = None, cache_dir=None, folder=None):
    """The shipped (trained) drafter of `family` for `target`, on the target's device, in the target's dtype unless
    `dtype` is given (from `folder` when it holds one, e.g. a Space's own copy; else by Hub id, see `find_shipped`), or
    None when none is found or the one found was not made for `target` (the shipped ones are the embedded
    SmolLM2-135M-Instruct's). Its `lookup_corpus` is its folder's (`write_shipped_corpus`), else
    `shipped_lookup_corpus()`. One line is appended to `why` when
    given: where the drafter came from, or why there is none."""
    reasons = []
    if folder is not None and (Path(folder) / "config.json").is_file():
        found = ShippedDrafter(family, shipped_repo_id(family), "folder", Path(folder), f"from {folder}")
    else:
        found = find_shipped(family, cache_dir, why=reasons)
    if found is not None:
        drafter = found.load(device=target.device, dtype=dtype or target.dtype)
        depth = target.config.get_text_config().num_hidden_layers
        try:
            drafter.check_target(target)
            if drafter.config.num_target_layers in (None, depth):
                if getattr(drafter, "lookup_corpus", None) is None:  # its folder's, else the checkout's replies
                    drafter.lookup_corpus = shipped_lookup_corpus()
                if why is not None:
                    why.append(f"the shipped {family} drafter {found.note}")
                return drafter
            reasons.append(f"the shipped {family} drafter ({found.note}) was made for a "
                           f"{drafter.config.num_target_layers}-layer target, this one has {depth} layers")
        except ValueError as exc:
            reasons.append(f"the shipped {family} drafter ({found.note}) does not fit this target: {exc}")
    if why is not None:
        why.extend(reasons)
    return None


def shipped_or_untrained(family: str, target, dtype=None, why: list | None = None, cache_dir=None, folder=None):
    """`(drafter, trained)`: `trained_drafter(...)`, or - for experiments - a fresh untrained one (`untrained_drafter`,
    on the target's device and dtype) when there is none, with the reason appended to `why`. What a user runs by
    default where no trained drafter fits is n-gram lookup instead (`pick_drafter`)."""
    drafter = trained_drafter(family, target, dtype=dtype, why=why, cache_dir=cache_dir, folder=folder)
    if drafter is not None:
        return drafter, True
    return untrained_drafter(family, target), False


NGRAM_LOOKUP_TOKENS = 10  # tokens an n-gram (prompt) lookup proposes per round where no trained drafter fits


@dataclass(frozen=True)
class DrafterChoice:
    """What `--drafter NAME` runs: `drafter` (None for n-gram lookup or no speculation) and `kind`: "trained" (a
    shipped drafter), "lookup" (n-gram lookup: no trained drafter fits the target), "untrained" (random weights, asked
    for by name), "given" (a folder or Hub id) or "none"; `note` says where it came from, or why lookup."""

    drafter: object
    kind: str
    note: str


def pick_drafter(name: str, target) -> DrafterChoice:
    """`--drafter NAME` beside `target`: "mtp" | "dflash" | "dfly" is the shipped trained drafter, or n-gram lookup
    (`NGRAM_LOOKUP_TOKENS`, which needs no training) where none fits the target - never an untrained drafter unless
    asked for: "untrained" (a fresh DFly) or "untrained:<family>", for experiments. "none": no speculation. Anything
    else is a drafter folder or Hub id (`drafter_for_target`)."""
    from angelspec_hf.modeling import DRAFTERS

    if name == "none":
        return DrafterChoice(None, "none", "no speculation")
    if name == "untrained" or name.startswith("untrained:"):
        family = name.partition(":")[2] or "dfly"
        if family not in DRAFTERS:
            raise ValueError(f"--drafter {name}: no drafter family {family!r}; choose one of {sorted(DRAFTERS)}")
        return DrafterChoice(untrained_drafter(family, target), "untrained",
                             f"an UNTRAINED {family} drafter (random weights), as asked")
    if name in DRAFTERS:
        why = []
        drafter = trained_drafter(name, target, why=why)
        if drafter is not None:
            return DrafterChoice(drafter, "trained", why[0])
        return DrafterChoice(None, "lookup", f"no trained {name} drafter for this target ({'; '.join(why)}): n-gram "
                             f"lookup of up to {NGRAM_LOOKUP_TOKENS} tokens instead, which needs no training "
                             f"(`--drafter untrained:{name}` runs an untrained one, for experiments)")
    return DrafterChoice(drafter_for_target(name, target), "given", f"from {name}")


def install_shipped(source=None, cache_dir=None, families=SHIPPED_FAMILIES) -> list[tuple[str, Path, str, bool]]:
    """Put the shipped drafters from `source` (a folder holding `smollm2-135m-instruct-<family>/`; default: this
    checkout's `drafters/`) into the HF cache under their Hub ids, after writing the weights its `weights.json` lists
    from git (`weights_store.materialise`; `WeightsStoreError` when git cannot). Returns `(repo id, snapshot,
    revision, changed)` per family, each checked with huggingface_hub's own offline resolution."""
    source = Path(source) if source is not None else SHIPPED_DIR
    if not source.is_dir():
        raise FileNotFoundError(f"{source} does not exist (an installed package carries no drafters/): pass --from "
                                "<a checkout's drafters/ folder>")
    missing = [f for f in families if not (source / f"{SHIPPED_PREFIX}{f}" / "config.json").is_file()]
    if missing:
        raise FileNotFoundError(f"{source} has no shipped drafter folder for {missing} "
                                f"(expected {SHIPPED_PREFIX}<family>/config.json)")
    # a checkout's weights live in git (source/weights.json): write the missing or differing ones first
    materialise(source, names=[f"{SHIPPED_PREFIX}{f}" for f in families])
    installed = []
    for family in families:
        repo_id = shipped_repo_id(family)
        # the lookup corpus of the replies beside that drafters/ folder (a checkout's), into the folder installed
        try:
            write_shipped_corpus(source / f"{SHIPPED_PREFIX}{family}")
        except OSError as error:  # a read-only checkout: installed without it (read from the replies instead)
            warnings.warn(f"the {family} drafter is installed without its lookup corpus: {error}", stacklevel=2)
        snapshot, revision, changed = install_folder(source / f"{SHIPPED_PREFIX}{family}", repo_id, cache_dir)
        resolved, why = _cached_snapshot(repo_id, hub_cache_dir(cache_dir))
        if resolved != snapshot:
            raise RuntimeError(f"huggingface_hub does not resolve {repo_id} to what was written ({snapshot}): {why}")
        installed.append((repo_id, snapshot, revision, changed))
    return installed
