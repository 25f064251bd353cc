"""Each shipped drafter folder carries exactly the modeling code that exporting the current `modeling/` writes, so a
folder loaded with `trust_remote_code=True` (where this library is not installed) behaves like the library."""

import pytest

from angelspec_hf.ship import export_drafter_code
from angelspec_hf.shipped import SHIPPED_DIR


@pytest.mark.parametrize("folder", sorted(p for p in SHIPPED_DIR.iterdir() if (p / "config.json").is_file()),
                         ids=lambda p: p.name)
def test_shipped_code_matches_an_export_of_modeling(folder, tmp_path):
    written = {p.name: p.read_text() for p in export_drafter_code(folder, tmp_path)}
    shipped = {p.name: p.read_text() for p in folder.glob("*.py")}
    assert sorted(shipped) == sorted(written), "run `python -m angelspec_hf.ship --code drafters/*`"
    stale = [name for name in written if shipped[name] != written[name]]
    assert not stale, f"{stale} differ from modeling/: run `python -m angelspec_hf.ship --code drafters/*`"
