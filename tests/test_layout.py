"""The test tree imports the same way under `pytest` as under `python -m pytest`.

`python -m pytest` puts the working directory on sys.path, the `pytest` script does not: a test
folder without `__init__.py`, or a test importing another folder's conftest, then works in one and
fails in the other (issue 12). Every folder under tests/ is a package, so pytest puts the
repository root on sys.path itself, and shared helpers live in tests/helpers/.
"""

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def _python_folders() -> list[Path]:
    return sorted({p.parent for p in TESTS.rglob("*.py") if "__pycache__" not in p.parts})


def test_every_test_folder_is_a_package():
    missing = [str(d.relative_to(TESTS.parent)) for d in _python_folders() if not (d / "__init__.py").exists()]
    assert not missing, f"add an __init__.py to {missing}"


def test_no_module_imports_a_conftest_or_a_bare_sibling():
    siblings = {p.stem for p in TESTS.rglob("*.py")} - {"__init__"}
    bad = []
    for path in TESTS.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([node.module or ""] if isinstance(node, ast.ImportFrom) and node.level == 0
                     else [a.name for a in node.names] if isinstance(node, ast.Import) else [])
            for name in names:
                if "conftest" in name.split(".") or name in siblings:
                    bad.append(f"{path.relative_to(TESTS.parent)}: {name}")
    assert not bad, f"import helpers from tests.helpers.<module> (or tests.<folder>.<module>): {bad}"
