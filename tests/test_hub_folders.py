"""A drafter's Hub folder carries its config, its model and its drafting (what `from_pretrained` needs to build and run
it), at most `FOLDER_LIMIT` lines of Python, none of the library's generate() hook; it builds and drafts where the
library is not installed; and building or loading a drafter patches nothing: only `import angelspec_hf` enables the
hook (`enable_generate_hook`), and `disable_generate_hook` gives transformers its methods back.

"Without the library" is checked two ways, by `tests/hub_folder_check.py` in a subprocess: with the library blocked
(a meta-path finder makes `angelspec_hf`, `modeling`, `tgi_patch` and `trainer` unimportable; fast, tiny models, every
run) and in a fresh virtual environment holding only torch, transformers and safetensors (`$ANGELSPEC_LEAN_VENV`,
default /tmp/lean-venv, built once and reused while its stamp matches these versions; the shipped drafters beside the
embedded target)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import safetensors
import torch
import transformers
from transformers.generation import GenerationMixin

import angelspec_hf
from angelspec_hf.modeling import DRAFTERS
from angelspec_hf.modeling.drafter_library import export_code
from angelspec_hf.shipped import SHIPPED_DIR
from helpers import tiny_drafter, tiny_target

FOLDER_LIMIT = 600  # non-blank lines of Python (docstrings and comments included: what a reader reads)
LIBRARY_FILES = {"candidate_generator.py", "draft_policy.py", "drafter_library.py", "converters.py"}
CHECK = Path(__file__).with_name("hub_folder_check.py")
SHIPPED = sorted(p for p in SHIPPED_DIR.iterdir() if (p / "config.json").is_file()) if SHIPPED_DIR.is_dir() else []


def python_lines(folder: Path) -> int:
    return sum(1 for p in folder.glob("*.py") for line in p.read_text().splitlines() if line.strip())


def assert_lean(folder: Path) -> None:
    names = {p.name for p in folder.glob("*.py")}
    assert names and not names & LIBRARY_FILES, sorted(names)
    assert python_lines(folder) <= FOLDER_LIMIT, f"{folder}: {python_lines(folder)} lines of Python"
    code = "\n".join(p.read_text() for p in folder.glob("*.py"))
    for library_only in ("GenerationMixin", "Path.home", "expanduser", "torch.ops.mkldnn"):
        assert library_only not in code, f"{folder} carries library code ({library_only})"


@pytest.mark.parametrize("family", sorted(DRAFTERS))
def test_an_export_is_lean(family, tmp_path):
    config_class, drafter_class = DRAFTERS[family]
    export_code(drafter_class, tmp_path)
    export_code(config_class, tmp_path)
    assert_lean(tmp_path)


@pytest.mark.parametrize("folder", SHIPPED, ids=lambda p: p.name)
def test_shipped_folders_are_lean(folder):
    assert_lean(folder)


def test_the_line_count_counts():
    """`python_lines` reads every non-blank line, so the limit bites (a folder of the old layout was over it)."""
    assert python_lines(Path(angelspec_hf.modeling.__file__).parent) > FOLDER_LIMIT


def test_import_enables_the_hook_and_disable_gives_transformers_its_methods_back(target):
    assert angelspec_hf.generate_hook_enabled()  # `import angelspec_hf` did it
    hooked = GenerationMixin._get_candidate_generator
    originals = {name: getattr(GenerationMixin, name).__wrapped__
                 for name in ("_get_candidate_generator", "_validate_generation_mode")}
    drafter = tiny_drafter("mtp", target)
    ids = torch.tensor([[5, 6, 7, 8]])
    try:
        angelspec_hf.disable_generate_hook()
        assert not angelspec_hf.generate_hook_enabled()
        assert all(getattr(GenerationMixin, name) is fn for name, fn in originals.items())
        with pytest.raises(AttributeError, match="pip install angelspec-hf"):  # transformers' own loop, a clear error
            target.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0, assistant_model=drafter)
    finally:
        angelspec_hf.enable_generate_hook()
    assert angelspec_hf.generate_hook_enabled() and GenerationMixin._get_candidate_generator is not hooked  # fresh
    angelspec_hf.enable_generate_hook()  # idempotent
    assert getattr(GenerationMixin._get_candidate_generator, "__wrapped__") is originals["_get_candidate_generator"]
    plain = target.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=0)
    assert torch.equal(plain, target.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=0,
                                              assistant_model=drafter))


def test_building_saving_or_loading_a_drafter_changes_no_other_class(target, tmp_path):
    angelspec_hf.disable_generate_hook()
    try:
        before = dict(vars(GenerationMixin))
        for family in ("mtp", "mtp_eagle3", "dflash", "dfly"):
            drafter = tiny_drafter(family, target)
            drafter.save_pretrained(tmp_path / family)
            angelspec_hf.load_drafter(tmp_path / family)
            transformers.AutoModel.from_pretrained(tmp_path / family, trust_remote_code=True)  # the folder's code
        assert dict(vars(GenerationMixin)) == before
    finally:
        angelspec_hf.enable_generate_hook()


def run_check(python, target_folder, folders, block: bool, timeout: int) -> list[dict]:
    command = [str(python), str(CHECK), str(target_folder), *map(str, folders)] + (["--block"] if block else [])
    run = subprocess.run(command, capture_output=True, text=True, timeout=timeout,
                         env={**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"})
    assert run.returncode == 0, run.stderr[-4000:]
    return [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]


def assert_runs_without_the_library(results: list[dict], folders) -> None:
    assert [r["folder"] for r in results] == [str(f) for f in folders]
    for r in results:
        assert not r["library_importable"] and r["module"].startswith("transformers_modules."), r
        assert r["generation_mixin_unchanged"] and r["draft_ok"], r
        assert "pip install angelspec-hf" in r["hook_error"], r
        if "builtin_dflash_identical" in r:
            assert r["builtin_dflash_identical"], r
        else:
            assert "pip install angelspec-hf" in r["generate_error"], r
    assert any("builtin_dflash_identical" in r for r in results), "no folder ran transformers' built-in DFlash path"


def test_tiny_folders_run_with_the_library_blocked(tmp_path):
    target = tiny_target()
    target.save_pretrained(tmp_path / "target")
    folders = []
    for family in ("mtp", "mtp_eagle3", "dflash", "dfly"):
        drafter = tiny_drafter(family, target)
        if family in ("mtp", "dfly"):  # a pruned draft vocabulary, as the shipped MTP and DFly drafters have
            drafter.set_draft_vocab(list(range(3, 80)))
        drafter.save_pretrained(tmp_path / family)
        folders.append(tmp_path / family)
    results = run_check(sys.executable, tmp_path / "target", folders, block=True, timeout=600)
    assert_runs_without_the_library(results, folders)


@pytest.fixture(scope="module")
def embedded_target_folder() -> Path:
    """The embedded target's converted HF folder (written by its first load)."""
    from angelspec_hf.targets import converted_target_dir, default_target_path

    folder = converted_target_dir(default_target_path())
    if not (folder / "model.safetensors").is_file():
        angelspec_hf.load_default_target()
    return folder


@pytest.mark.real_model
@pytest.mark.skipif(not SHIPPED, reason="no drafters/ folder (an installed package)")
def test_shipped_folders_run_with_the_library_blocked(embedded_target_folder):
    results = run_check(sys.executable, embedded_target_folder, SHIPPED, block=True, timeout=900)
    assert_runs_without_the_library(results, SHIPPED)


def lean_venv_python() -> Path:
    """A virtual environment with only torch, transformers and safetensors at this environment's versions, made once
    (`python -m venv` from a venv starts from the base interpreter, without any of this one's packages)."""
    root = Path(os.environ.get("ANGELSPEC_LEAN_VENV", "/tmp/lean-venv"))
    python = root / "bin" / "python"
    spec = [f"torch=={torch.__version__.split('+')[0]}", f"transformers=={transformers.__version__}",
            f"safetensors=={safetensors.__version__}"]
    stamp = root / ".angelspec-lean-venv"
    if stamp.is_file() and stamp.read_text() == " ".join(spec) and python.is_file():
        return python
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(root)], check=True, timeout=300)
    pip = subprocess.run([str(python), "-m", "pip", "install", "-q", *spec], capture_output=True, text=True,
                         timeout=3000)
    if pip.returncode:
        unreachable = ("No matching distribution", "Could not find a version", "Failed to establish",
                       "Network is unreachable", "Temporary failure in name resolution", "ConnectionError")
        if any(text in pip.stdout + pip.stderr for text in unreachable):
            pytest.skip(f"pip cannot reach the package registry to build {root}: {pip.stderr.strip()[-300:]}")
        raise AssertionError(f"pip install {' '.join(spec)} failed:\n{pip.stderr[-3000:]}")
    stamp.write_text(" ".join(spec))
    return python


@pytest.mark.real_model
@pytest.mark.skipif(not SHIPPED, reason="no drafters/ folder (an installed package)")
def test_shipped_folders_run_in_a_fresh_venv(embedded_target_folder):
    python = lean_venv_python()
    probe = subprocess.run([str(python), "-c", "import angelspec_hf"], capture_output=True, text=True)
    assert probe.returncode and "angelspec_hf" in probe.stderr, "the fresh venv must not see the library"
    results = run_check(python, embedded_target_folder, SHIPPED, block=False, timeout=900)
    assert_runs_without_the_library(results, SHIPPED)
