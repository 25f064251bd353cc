"""`scripts/tau_by_training.py`: checkpoints named by a commit of this repository are exactly the files committed
there, and the curve is drawn with variants (same step count) apart from the line."""

import importlib.util
from pathlib import Path

from angelspec_hf.weights_store import read_manifest, sha256_file

ROOT = Path(__file__).resolve().parent.parent
DFLY = "drafters/smollm2-135m-instruct-dfly"


def load_script():
    spec = importlib.util.spec_from_file_location("tau_by_training", ROOT / "scripts" / "tau_by_training.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_checkpoint_from_git_history_is_the_committed_drafter(tmp_path):
    script = load_script()
    label, steps, source = script.parse_checkpoint(f"round 5, shipped:4400:git:HEAD:{DFLY}")
    assert (label, steps, source) == ("round 5, shipped", 4400, f"git:HEAD:{DFLY}")
    folder = script.materialise(source, tmp_path)
    assert (folder / "config.json").read_bytes() == (ROOT / DFLY / "config.json").read_bytes()
    # the weights: committed as a file, or (since they left the tree) the git blob drafters/weights.json names
    [entry] = [e for e in read_manifest(ROOT / "drafters") if e.path == f"{Path(DFLY).name}/model.safetensors"]
    assert sha256_file(folder / "model.safetensors") == entry.sha256
    assert script.materialise("runs/dfly", tmp_path) == Path("runs/dfly")  # a folder is used as it is


def test_the_curve_is_drawn(tmp_path):
    script = load_script()
    rows = [{"label": "a", "steps": 100, "tau": 1.5, "first": 0.3}, {"label": "b", "steps": 200, "tau": 1.8, "first": 0.4},
            {"label": "b, grown", "steps": 200, "tau": 1.8, "first": 0.42}]
    script.plot(rows, tmp_path / "curve.png")
    assert (tmp_path / "curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
