"""The layout the docs promise, checked on the import statements and SQL calls of each module,
so a shortcut through the wrong layer fails here rather than in a review:

- the store alone speaks SQL, and in the coordinator only `transport.py` speaks MPI;
- imports go one way: no cycle among the modules of `coordinator/` and `store/`, imports
  inside functions included;
- a worker rank loads neither the store nor SQLAlchemy (the master alone opens the database).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("coordinator", "store")


def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), filename=str(path))


def _imports_and_calls(path: Path) -> tuple[set[str], set[str]]:
    imported: set[str] = set()
    called: set[str] = set()
    for node in ast.walk(_tree(path)):
        if isinstance(node, ast.Import):
            imported.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            imported.add(node.module.split(".")[0])
        elif isinstance(node, ast.Attribute):
            called.add(node.attr)
    return imported, called


def module_imports(path: Path, package: str) -> set[str]:
    """Every module of ours that `path` imports, anywhere in it (inside functions too), as
    dotted names: `from . import x` and `from .x import y` both count as importing `.x`."""
    ours = set()
    for node in ast.walk(_tree(path)):
        if isinstance(node, ast.Import):
            ours.update(a.name for a in node.names if a.name.split(".")[0] in PACKAGES)
        elif isinstance(node, ast.ImportFrom):
            base = (f"{package}.{node.module}" if node.level == 1 and node.module else
                    package if node.level == 1 else node.module or "")
            if base.split(".")[0] not in PACKAGES:
                continue
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                ours.add(sub if _module_path(sub) is not None else base)
    return {m for m in ours if _module_path(m) is not None}


def _module_path(name: str) -> Path | None:
    parts = name.split(".")
    path = ROOT.joinpath(*parts).with_suffix(".py")
    if path.is_file():
        return path
    init = ROOT.joinpath(*parts, "__init__.py")
    return init if init.is_file() else None


def import_graph() -> dict[str, set[str]]:
    graph = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).glob("*.py")):
            name = package if path.stem == "__init__" else f"{package}.{path.stem}"
            graph[name] = module_imports(path, package) - {name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle, as the list of modules around it; None if there is none."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)) is not None:
                return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)) is not None:
            return found
    return None


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


def test_imports_go_one_way():
    assert find_cycle(import_graph()) is None, " -> ".join(find_cycle(import_graph()) or [])


def test_the_cycle_finder_sees_a_cycle_through_a_function_level_import(tmp_path):
    """The check above is only as good as this: an import inside a function counts."""
    graph = import_graph()
    path = tmp_path / "tasks.py"  # store.campaign imports store.tasks
    path.write_text("def f():\n    from .campaign import Store\n")
    graph["store.tasks"] |= module_imports(path, "store")
    cycle = find_cycle(graph)
    assert cycle is not None and {"store.tasks", "store.campaign"} <= set(cycle)


def closure(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        node = todo.pop()
        if node not in seen:
            seen.add(node)
            todo.extend(graph.get(node, ()))
    return seen


def test_a_worker_never_imports_the_store():
    """Everything `coordinator.worker` imports, anywhere in it and in what it imports
    (functions included: a lazy import still runs on a worker rank)."""
    reached = closure(import_graph(), "coordinator.worker")
    assert not {m for m in reached if m.startswith("store")}, sorted(reached)


def loaded_after(steps: str, wanted: str) -> list[str]:
    """The modules a fresh interpreter has loaded after running `steps` (Python source), of
    those for which `wanted` (an expression over the module's name `m`) is true."""
    probe = f"import sys\n{steps}\nprint(sorted(m for m in sys.modules if {wanted}))\n"
    done = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return ast.literal_eval(done.stdout.strip().splitlines()[-1])


def test_a_worker_rank_loads_neither_the_store_nor_sqlalchemy():
    """The path a worker rank takes, run for real up to the MPI start: the command line,
    its checks, the runtime and the worker (with fault injection, which only workers load)."""
    assert loaded_after(
        "from coordinator import cli, runtime, worker, faults\n"
        "from coordinator.config import resolve_run\n"
        "ns = cli._parser().parse_args(['run', '--db', 'x.db', '--demo', '3',"
        " '--inject', 'slow=0.1'])\n"
        "resolve_run(ns)",
        "m.split('.')[0] in ('store', 'sqlalchemy', 'alembic')") == []


def test_the_status_command_loads_neither_sqlalchemy_nor_alembic(tmp_path: Path):
    """`coordinator status`, run for real on a finished campaign (every reader it has, the
    rates, the ranks and the failures included): SQLAlchemy's import alone is 0.3-0.5 s of
    a start on a 2-core node, more than the whole command takes without it."""
    from campaigns import finding_campaign
    db = tmp_path / "c.db"
    finding_campaign(db, tasks=30)
    assert loaded_after(
        "from coordinator.cli import main\n"
        f"assert main(['status', '--db', {str(db)!r}]) == 0\n"
        f"assert main(['status', '--json', '--db', {str(db)!r}]) == 0",
        "m.split('.')[0] in ('sqlalchemy', 'alembic')") == []


def test_the_command_line_parser_loads_no_executor():
    """`coordinator status` and the other operator commands parse their command line with
    the same parser as `run`: it needs the executors' names, not the executors (with the
    wire format, ~60 ms of every command's start)."""
    assert loaded_after("from coordinator import cli\n"
                        "cli._parser().parse_args(['status', '--db', 'x.db'])",
                        "m in ('coordinator.executors', 'coordinator.wire')") == []
