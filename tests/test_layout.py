"""The layout the README promises: the store alone speaks SQL, and in the coordinator only
`transport.py` speaks MPI. Checked on the import statements and SQL calls of each module, so a
shortcut through the wrong layer fails here rather than in a review."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _imports_and_calls(path: Path) -> tuple[set[str], set[str]]:
    tree = ast.parse(path.read_text(), filename=str(path))
    imported: set[str] = set()
    called: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            imported.add(node.module.split(".")[0])
        elif isinstance(node, ast.Attribute):
            called.add(node.attr)
    return imported, called


def test_the_coordinator_speaks_no_sql_and_only_its_transport_speaks_mpi():
    for path in sorted((ROOT / "coordinator").glob("*.py")):
        imported, called = _imports_and_calls(path)
        assert not imported & {"sqlalchemy", "sqlite3", "alembic"}, path.name
        assert not called & {"execute", "executemany", "exec_driver_sql"}, path.name
        if path.name != "transport.py":
            assert "mpi4py" not in imported, path.name


def test_the_store_speaks_no_mpi():
    for path in sorted((ROOT / "store").glob("*.py")):
        imported, _ = _imports_and_calls(path)
        assert not imported & {"mpi4py", "coordinator"}, path.name
