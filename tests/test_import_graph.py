"""The layout's rules, read from the import graph (every import counts: deferred ones inside
functions and type-only ones under `if TYPE_CHECKING:` too).

- jpaged/ is in wings, each a layer that imports only from layers below it (and from itself):
  config < core < models < executors < engine < {paper, text} < entrypoints < the package's front door.
- The core (and the configuration it builds on) imports no jax, flax or kernel code.
- Inside the core, three rooms in layers: the contract (modules directly in jpaged/core/) < kv/
  (memory) < sched/ (scheduling): the contract imports neither room, kv never imports sched.
- pallas_kernels imports nothing from jpaged; the library never imports experiments or tests.
- No import circles anywhere in jpaged/ or pallas_kernels/.
- At most 14 entries directly under jpaged/.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("jpaged", "pallas_kernels")
# The layer of each wing of jpaged (a module may import its own wing and lower layers only).
LAYERS = {"config": 0, "core": 1, "models": 2, "executors": 3, "engine": 4, "paper": 5, "text": 5,
          "entrypoints": 6, "": 7}
HEAVY = ("jax", "jaxlib", "flax", "optax", "orbax", "pallas_kernels")  # what the core must never import
CONFIG_MAY_IMPORT = {"pallas_kernels.backend_names"}  # the backend names (no jax) the config checks


def _modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in (REPO / package).rglob("*.py"):
            parts = list(path.relative_to(REPO).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


MODULES = _modules()


def _imports(name: str, path: Path) -> set[str]:
    """Every module name `name` imports (absolute, resolved), anywhere in the file."""
    is_package = path.name == "__init__.py"
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".")[: len(name.split(".")) - node.level + is_package]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            for alias in node.names:  # `from package import module` imports the module
                out.add(f"{module}.{alias.name}" if f"{module}.{alias.name}" in MODULES else module)
    return out


def _resolve(name: str) -> str | None:
    """The project module `name` names (a submodule's attribute resolves to the submodule)."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


IMPORTS = {name: _imports(name, path) for name, path in MODULES.items()}
GRAPH = {name: {m for m in map(_resolve, imported) if m and m != name} for name, imported in IMPORTS.items()}


def _wing(module: str) -> str:
    """The wing of a jpaged module: its folder under jpaged/, `engine`, or "" (the front door)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def _cycles() -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in GRAPH[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(GRAPH):
        if v not in index:
            visit(v)
    return found


def test_no_import_circles():
    assert _cycles() == []


def test_every_wing_imports_only_from_layers_below_it():
    wrong = [f"{a} -> {b}" for a, targets in GRAPH.items() if a.startswith("jpaged") for b in targets
             if b.startswith("jpaged") and _wing(b) != _wing(a) and LAYERS[_wing(b)] >= LAYERS[_wing(a)]]
    assert not wrong, "imports that point up (or sideways between wings of one layer):\n" + "\n".join(wrong)
    assert set(map(_wing, (m for m in MODULES if m.startswith("jpaged")))) <= set(LAYERS)


CORE_ROOMS = {"": 0, "kv": 1, "sched": 2}  # the contract, memory, scheduling


def _room(module: str) -> str:
    """The room of a core module: its folder under jpaged/core/, or "" (the contract)."""
    parts = module.split(".")
    return parts[2] if len(parts) > 2 and parts[2] in CORE_ROOMS else ""


def test_the_core_rooms_import_only_downwards():
    core = [m for m in MODULES if m.startswith("jpaged.core.")]
    assert {_room(m) for m in core} == set(CORE_ROOMS), sorted({_room(m) for m in core})
    wrong = [f"{a} -> {b}" for a in core for b in GRAPH[a]
             if b.startswith("jpaged.core.") and _room(b) != _room(a) and CORE_ROOMS[_room(b)] > CORE_ROOMS[_room(a)]]
    assert not wrong, "core modules that import a room above their own:\n" + "\n".join(wrong)


def test_the_core_imports_no_jax_and_no_kernels():
    wrong = []
    for name, imported in IMPORTS.items():
        if _wing(name) not in ("core", "config") or not name.startswith("jpaged."):
            continue
        for module in imported:
            top = module.split(".")[0]
            if top in HEAVY and module not in CONFIG_MAY_IMPORT:
                wrong.append(f"{name} imports {module}")
    assert not wrong, wrong
    allowed = CONFIG_MAY_IMPORT | {m for m in MODULES if _wing(m) in ("core", "config") and m.startswith("jpaged.")}
    for module in CONFIG_MAY_IMPORT:  # what the core may reach outside jpaged imports nothing heavy either
        assert not {m for m in IMPORTS[module] if m.split(".")[0] in HEAVY} - allowed


def test_importing_the_core_loads_no_jax():
    core = sorted(m for m in MODULES if m.startswith(("jpaged.core", "jpaged.config")))
    code = f"import sys\nfor m in {core!r}: __import__(m)\nprint(sorted(k for k in sys.modules if k.split('.')[0] in {HEAVY!r}))"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True).stdout
    assert out.strip() == "['pallas_kernels', 'pallas_kernels.backend_names']"


def test_kernels_import_nothing_from_jpaged_and_the_library_no_experiments():
    wrong = [f"{a} -> {b}" for a, imported in IMPORTS.items() for b in imported
             if (a.startswith("pallas_kernels") and b.split(".")[0] == "jpaged")
             or b.split(".")[0] in ("experiments", "tests")]
    assert not wrong, wrong


def test_few_entries_at_the_top_of_the_package():
    entries = [p.name for p in (REPO / "jpaged").iterdir() if p.name != "__pycache__"]
    assert len(entries) <= 14, sorted(entries)
