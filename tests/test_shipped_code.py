"""Each shipped drafter folder carries exactly the modeling code that exporting the current `modeling/` writes, so a
folder loaded with `trust_remote_code=True` builds and drafts as the library's classes do (its size and what it runs
without the library: `tests/test_hub_folders.py`)."""

import pytest

from angelspec_hf.ship import export_drafter_code
from angelspec_hf.shipped import SHIPPED_DIR


@pytest.mark.parametrize("folder", sorted(p for p in SHIPPED_DIR.iterdir() if (p / "config.json").is_file()),
                         ids=lambda p: p.name)
def test_shipped_code_matches_an_export_of_modeling(folder, tmp_path):
    written = {p.name: p.read_text() for p in export_drafter_code(folder, tmp_path)}
    shipped = {p.name: p.read_text() for p in folder.glob("*.py")}
    assert sorted(shipped) == sorted(written), "run `python -m angelspec_hf.ship --code drafters/*/`"
    stale = [name for name in written if shipped[name] != written[name]]
    assert not stale, f"{stale} differ from modeling/: run `python -m angelspec_hf.ship --code drafters/*/`"


@pytest.mark.parametrize("family,own", [("mtp", {"mtp"}), ("dflash", {"dflash"}), ("dfly", {"dflash", "dfly"})])
def test_an_export_carries_only_its_familys_code(family, own, tmp_path):
    from angelspec_hf.modeling import DRAFTERS
    from angelspec_hf.modeling.drafter_library import export_code

    config_cls, drafter_cls = DRAFTERS[family]
    names = {p.name for p in export_code(drafter_cls, tmp_path) + export_code(config_cls, tmp_path)}
    families = {n.split("_", 1)[1][:-3] for n in names if n.startswith(("modeling_", "configuration_"))} - {"drafter"}
    assert families == own and "converters.py" not in names, sorted(names)
