"""The package's import graph has no cycle: every `import` between this repository's modules, at module
level or inside a function, is an edge, and the graph over `angelspec_hf`, `modeling/`, `trainer/` and `tgi_patch/`
(installed as `angelspec_hf.modeling`, ... by pyproject.toml's `package-dir`) must be acyclic. Read with `ast`, so
nothing is imported and optional dependencies (triton, fastapi) need not be installed."""

import ast
import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("angelspec_hf", "angelspec_hf.modeling", "angelspec_hf.trainer", "angelspec_hf.tgi_patch")


def package_modules() -> dict[str, Path]:
    """Dotted module name -> file, for every module of the packages above (package-dir mapping applied)."""
    package_dir = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    modules = {}
    for package in PACKAGES:
        folder = ROOT / package_dir[package]
        for path in sorted(folder.rglob("*.py")):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join([package, *parts])] = path
    return modules


def imported_modules(name: str, path: Path, known: set[str]) -> set[str]:
    """The known modules that `name` (at `path`) imports anywhere in its body. `from p import x` is an edge to the
    module `p.x` when there is one, else to `p`."""
    is_package = path.name == "__init__.py"
    base = name.split(".") if is_package else name.split(".")[:-1]
    edges = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level:
                anchor = base[: len(base) - node.level + 1]
                module = ".".join(anchor + ([module] if module else []))
            targets = [f"{module}.{alias.name}" if f"{module}.{alias.name}" in known else module
                       for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in known:  # `import a.b.c` of an unknown leaf: its nearest known package
                target = target.rpartition(".")[0]
            if target and target != name:
                edges.add(target)
    return edges


def import_graph() -> dict[str, set[str]]:
    modules = package_modules()
    return {name: imported_modules(name, path, set(modules)) for name, path in modules.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of `graph` as `[a, b, ..., a]`, or None (iterative depth-first search, nodes in sorted order)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    for root in sorted(graph):
        if state.get(root):
            continue
        path, stack = [root], [iter(sorted(graph[root]))]
        state[root] = 1
        while stack:
            child = next(stack[-1], None)
            if child is None:
                state[path.pop()] = 2
                stack.pop()
            elif state.get(child) == 1:
                return path[path.index(child):] + [child]
            elif not state.get(child):
                state[child] = 1
                path.append(child)
                stack.append(iter(sorted(graph.get(child, ()))))
    return None


def test_cycle_finder_finds_a_cycle_and_accepts_a_dag():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set(), "d": {"a", "c"}}) is None
    assert find_cycle({"x": {"x2"}, "x2": {"x"}}) == ["x", "x2", "x"]


def test_graph_sees_module_and_function_level_and_relative_imports(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("from .a import f\n")
    (pkg / "a.py").write_text("def f():\n    from pkg import b\n")
    (pkg / "b.py").write_text("from . import a\n")
    files = {"pkg": pkg / "__init__.py", "pkg.a": pkg / "a.py", "pkg.b": pkg / "b.py"}
    graph = {name: imported_modules(name, path, set(files)) for name, path in files.items()}
    assert graph == {"pkg": {"pkg.a"}, "pkg.a": {"pkg.b"}, "pkg.b": {"pkg.a"}}
    assert find_cycle(graph) == ["pkg.a", "pkg.b", "pkg.a"]


def test_no_import_cycle_in_the_package():
    graph = import_graph()
    assert "angelspec_hf.tgi_patch.engine" in graph and "angelspec_hf.trainer" in graph  # the graph is not empty
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_docstrings_name_files_that_exist():
    """A file a `tgi_patch` docstring names (`scheduler.py`, `kernels/reference.py`) exists in the package (or, with a
    folder, in the repository): a renamed module leaves no stale pointer (as `reference.py` once sent readers to
    `kernels.py` for the Triton versions)."""
    folder = ROOT / "tgi_patch"
    files = [p.relative_to(ROOT).as_posix() for p in folder.rglob("*.py")]
    stale = {}
    for path in folder.rglob("*.py"):
        doc = ast.get_docstring(ast.parse(path.read_text())) or ""
        named = set(re.findall(r"`((?:[\w/]+/)?\w+\.py)`", doc))
        missing = sorted(n for n in named if not any(f.endswith("/" + n) for f in files) and not (ROOT / n).is_file())
        if missing:
            stale[str(path.relative_to(ROOT))] = missing
    assert not stale, f"docstrings name files that do not exist: {stale}"


def test_kernels_and_references_point_at_each_other():
    """The torch reference says where its Triton version is, and the kernel module says where its reference is."""
    folder = ROOT / "tgi_patch" / "engine" / "kernels"
    reference, kernels = (ast.get_docstring(ast.parse((folder / name).read_text())) or ""
                          for name in ("reference.py", "triton_kernels.py"))
    assert "`triton_kernels.py`" in reference and "`reference.py`" in kernels
