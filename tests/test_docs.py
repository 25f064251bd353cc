"""The README is the front door and `docs/` the manual: the README stays short, speaks of the project (not of the work
that made it), and links only to files that exist; the MkDocs site builds with `--strict` (no warnings, no broken
internal links or anchors)."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import unicodedata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
MAX_README_LINES = 250

# Work-log wording: issue references ("#38", "issue 12"), sessions, and the machine of the day. A Markdown anchor
# (`docs/x.md#section`) is not an issue reference: `#` must not follow a word character, `/`, `.`, `)` or `#`.
WORK_LOG = {
    "an issue reference (#N)": re.compile(r"(?<![\w/.)#`])#\d+\b"),
    "an issue number": re.compile(r"\bissues? \d+", re.IGNORECASE),
    "a session": re.compile(r"\bsessions?\b", re.IGNORECASE),
    "this machine": re.compile(r"\bthis machine\b", re.IGNORECASE),
}
# Markdown links and images: [text](target) / ![alt](target), the target up to whitespace or ")".
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
EXPLICIT_ID = re.compile(r"\{\s*#([\w-]+)[^}]*\}\s*$")


def work_log_hits(text: str) -> list[str]:
    """`kind: line` for every line of `text` with work-log wording."""
    return [f"{kind}: {line.strip()}" for line in text.splitlines() for kind, pattern in WORK_LOG.items()
            if pattern.search(line)]


def relative_links(text: str) -> list[str]:
    """The link and image targets of Markdown `text` that point into the repository (no scheme, not a bare anchor),
    with code spans and fenced code blocks left out."""
    text = re.sub(r"```.*?```", "", text, flags=re.DOTALL)
    text = re.sub(r"`[^`\n]*`", "", text)
    targets = LINK.findall(text)
    return [t for t in targets if not re.match(r"^[a-z][a-z0-9+.-]*:", t, re.IGNORECASE) and not t.startswith("#")]


def slugify(heading: str) -> str:
    """Python-Markdown's `toc` slug of a heading's text (what MkDocs makes anchors of)."""
    text = heading.replace("`", "")
    text = unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode("ascii")
    text = re.sub(r"[^\w\s-]", "", text).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def anchors(markdown_file: Path) -> set[str]:
    """The anchors a Markdown file's headings get: an explicit `{#id}`, else the slug of the heading's text."""
    found = set()
    in_fence = False
    for line in markdown_file.read_text(encoding="utf-8").splitlines():
        if line.lstrip().startswith("```"):
            in_fence = not in_fence
        if in_fence or not re.match(r"#{1,6} ", line):
            continue
        heading = line.lstrip("#").strip()
        explicit = EXPLICIT_ID.search(heading)
        found.add(explicit.group(1) if explicit else slugify(heading))
    return found


def test_the_readme_is_short():
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= MAX_README_LINES, (
        f"README.md has {len(lines)} lines (at most {MAX_README_LINES}): move detail into docs/")


def test_the_readme_speaks_of_the_project_not_of_the_work():
    hits = work_log_hits(README.read_text(encoding="utf-8"))
    assert not hits, "work-log wording in README.md:\n" + "\n".join(hits)


# In docs/, "session" may name a GPU machine's lending period (docs/gpu.md); a numbered session may not.
DOCS_WORK_LOG = re.compile(WORK_LOG["an issue reference (#N)"].pattern + r"|\bissues? #?\d+|\bsessions? \d+|\bthis session\b",
                           re.IGNORECASE)


def test_the_docs_carry_no_issue_or_session_references():
    hits = [f"{path.relative_to(ROOT)}: {line.strip()}" for path in sorted((ROOT / "docs").rglob("*.md"))
            for line in path.read_text(encoding="utf-8").splitlines() if DOCS_WORK_LOG.search(line)]
    assert not hits, "issue or session references in docs/:\n" + "\n".join(hits)


def test_the_work_log_check_can_fail():
    assert work_log_hits("Fixed in #38.") and work_log_hits("as issue 12 asks") and work_log_hits("in session 7")
    assert work_log_hits("measured on this machine today")
    assert DOCS_WORK_LOG.search("in session 29") and DOCS_WORK_LOG.search("Issue #12's targets")
    assert not DOCS_WORK_LOG.search("15 device-minutes a session")
    assert not work_log_hits("see [Benchmarks](docs/benchmarks.md#batch-1-angelspec-bench), `(1)` and 2^64")


def test_every_relative_link_in_the_readme_exists():
    links = relative_links(README.read_text(encoding="utf-8"))
    assert len(links) >= 5, f"found only {links}: the link pattern no longer matches the README"
    missing, bad_anchors = [], []
    for link in links:
        path, _, anchor = link.partition("#")
        target = (ROOT / path).resolve()
        if not target.exists():
            missing.append(link)
        elif anchor and target.suffix == ".md" and anchor not in anchors(target):
            bad_anchors.append(link)
    assert not missing, f"README.md links to files that do not exist: {missing}"
    assert not bad_anchors, f"README.md links to headings that do not exist: {bad_anchors}"


def test_the_link_checker_sees_links_and_anchors():
    assert relative_links("[a](docs/x.md#y) ![p](img.png) [w](https://x.org) [h](#top) `[c](no.md)`") == [
        "docs/x.md#y", "img.png"]
    assert slugify("Batch 1: `angelspec bench`") == "batch-1-angelspec-bench"
    assert slugify("The cost-aware draft length (batch 1)") == "the-cost-aware-draft-length-batch-1"
    assert "batch-1-angelspec-bench" in anchors(ROOT / "docs" / "benchmarks.md")


_DOCS_MODULES = ("mkdocs", "material", "mkdocstrings", "mkdocstrings_handlers.python")


def _missing_docs_modules() -> list[str]:
    missing = []
    for name in _DOCS_MODULES:
        try:
            found = importlib.util.find_spec(name) is not None
        except ModuleNotFoundError:  # a parent package is missing
            found = False
        if not found:
            missing.append(name)
    return missing


def test_the_docs_site_builds_strictly(tmp_path):
    missing = _missing_docs_modules()
    if missing:
        pytest.skip(f"the docs tools are not installed ({', '.join(missing)}): pip install mkdocs mkdocs-material "
                    "'mkdocstrings[python]' (the docs extra)")
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    result = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file",
                             str(ROOT / "mkdocs.yml"), "--site-dir", str(tmp_path / "site")],
                            cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, f"mkdocs build --strict failed:\n{result.stdout}\n{result.stderr}"
    assert (tmp_path / "site" / "api" / "engine" / "index.html").read_text(encoding="utf-8").count(
        "SpeculativeEngine") > 1, "the API pages came out without the engine's docstrings"
