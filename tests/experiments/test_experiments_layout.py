"""experiments/ imports one way: the figure packages and groups import the shared modules
(experiments/common.py, serving.py, plots.py, markdown.py), experiments/report/ imports the figure
packages' report sections, and no module outside experiments/report/ imports experiments.report.
Read from the source with ast (nothing is imported), so a circle is caught even where Python's
import order happens to tolerate it."""

import ast
from pathlib import Path

from experiments.common import REPO_ROOT

EXPERIMENTS = REPO_ROOT / "experiments"
REPORT = "experiments.report"


def _module_name(path: Path) -> str:
    parts = path.relative_to(REPO_ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    """Every module under experiments/: dotted name -> file."""
    return {_module_name(p): p for p in sorted(EXPERIMENTS.rglob("*.py")) if "__pycache__" not in p.parts}


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The experiments modules `name` imports anywhere in its file (a function-level import is a
    dependency too): `from a import b` names a.b where b is a module, else a; relative imports are
    resolved against `name`'s package."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            found |= {f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names}
    return {m for m in found if m in known}


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, set(modules)) - {name} for name, path in modules.items()}


def _in_report(module: str) -> bool:
    return module == REPORT or module.startswith(REPORT + ".")


def test_graph_sees_the_report_importing_the_figure_sections():
    # The parser works: the report's document imports a figure's section and the shared helpers.
    graph = _graph()
    assert {"experiments.throughput.report", "experiments.markdown"} <= graph["experiments.report.document"]
    assert "experiments.common" in graph["experiments.throughput"]


def test_nothing_outside_experiments_report_imports_it():
    bad = sorted(f"{m} imports {', '.join(sorted(filter(_in_report, deps)))}"
                 for m, deps in _graph().items() if not _in_report(m) and any(map(_in_report, deps)))
    assert not bad, f"move what these need from experiments/report/ into a shared module (experiments/*.py): {bad}"


def _circle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle in `graph` (its modules in order, the first repeated last), or None."""
    state: dict[str, str] = {}  # module -> "open" while on the depth-first path, "done" after
    path: list[str] = []

    def visit(module: str) -> list[str] | None:
        state[module] = "open"
        path.append(module)
        for dep in sorted(graph[module]):
            if state.get(dep) == "open":
                return path[path.index(dep):] + [dep]
            if dep not in state and (found := visit(dep)):
                return found
        path.pop()
        state[module] = "done"
        return None

    for module in sorted(graph):
        if module not in state and (found := visit(module)):
            return found
    return None


def test_circle_finder_finds_circles():
    assert _circle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert _circle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_no_import_circle_among_experiments_modules():
    circle = _circle(_graph())
    assert circle is None, f"import circle: {' -> '.join(circle)}"


def _folder(module: str) -> str:
    """The folder a module belongs to: experiments.<name> for a package's modules (experiments.report
    for experiments.report.document), the module itself for experiments/*.py."""
    return ".".join(module.split(".")[:2])


def test_no_import_circle_among_experiments_folders():
    # A circle between folders can hide from the module graph: report/document.py importing
    # throughput/report.py, which imported a leaf module of report/, is no circle module by module.
    folders: dict[str, set[str]] = {}
    for module, deps in _graph().items():
        folders.setdefault(_folder(module), set()).update(_folder(d) for d in deps)
    circle = _circle({folder: deps - {folder} for folder, deps in folders.items()})
    assert circle is None, f"import circle between folders: {' -> '.join(circle)}"
