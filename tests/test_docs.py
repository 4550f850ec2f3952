"""The docs are the user's manual: they must resolve, stay short where promised, and agree with
the code they describe (the SQL queries they give are run by tests/test_docs_sql.py)."""

from __future__ import annotations

import json
import re
from pathlib import Path

from coordinator.exits import ExitStatus

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
CODE = [p for d in ("coordinator", "store", "migrations", "tools", "tests")
        for p in sorted((ROOT / d).rglob("*.py")) if p.name != "test_docs.py"]


def test_the_readme_is_a_front_door():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 300, len(lines)
    text = "\n".join(lines[:40])
    # The two set-up commands come first: the demo and the tests.
    assert ".venv/bin/coordinator run --db demo.db" in text
    assert ".venv/bin/python -m pytest" in text


def test_every_link_in_the_docs_resolves():
    for page in DOCS:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text()):
            if re.match(r"[a-z]+://", target):
                continue
            assert (page.parent / target).exists(), f"{page.name}: {target}"


def _anchors(page: Path) -> set[str]:
    """The anchors GitHub gives the page's headings: lower case, punctuation dropped, spaces
    as hyphens, a repeated one numbered."""
    seen: dict[str, int] = {}
    out = set()
    in_code = False
    for line in page.read_text().splitlines():
        if line.startswith("```"):
            in_code = not in_code
        m = None if in_code else re.match(r"#{1,6} (.*)", line)
        if m is None:
            continue
        slug = re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def test_every_anchor_a_link_names_is_a_heading_of_its_page():
    broken = []
    for page in DOCS:
        for target, anchor in re.findall(r"\]\(([^)#\s]*)#([^)\s]+)\)", page.read_text()):
            if re.match(r"[a-z]+://", target):
                continue
            linked = (page.parent / target) if target else page
            if linked.suffix == ".md" and anchor not in _anchors(linked):
                broken.append(f"{page.name}: {target}#{anchor}")
    assert broken == []


def test_every_docs_citation_in_the_code_resolves_and_none_points_outside():
    for path in CODE + DOCS:
        text = path.read_text()
        for cited in re.findall(r"docs/([\w.-]+\.md)", text):
            assert (ROOT / "docs" / cited).is_file(), f"{path.relative_to(ROOT)}: docs/{cited}"
        # The specification and the measured notes live outside the repository; the code
        # cites their pages in docs/ instead.
        assert not re.search(r"\bSPEC\b|\bNOTES\b|shared/", text), path.relative_to(ROOT)


def test_no_absolute_path_of_a_machine_in_the_docs():
    for page in DOCS:
        found = re.findall(r"(?<![\w.])/(?:tmp|work|root|home)/\w", page.read_text())
        assert not found, (page.name, found)


def test_the_readme_exit_table_is_the_enum():
    text = (ROOT / "README.md").read_text()
    rows = dict(re.findall(r"^\| (\d+) \| `(\w+)` \|", text, re.M))
    assert rows == {str(int(s)): s.name for s in ExitStatus}


def test_every_run_option_is_in_the_readme_settings_table():
    """`coordinator run --help` and the README's table of settings name the same options."""
    import argparse

    from coordinator.cli import _parser
    sub = next(a for a in _parser()._actions if isinstance(a, argparse._SubParsersAction))
    options = {o for a in sub.choices["run"]._actions for o in a.option_strings
               if o.startswith("--") and o != "--help" and a.help != argparse.SUPPRESS}
    table = "\n".join(line for line in (ROOT / "README.md").read_text().splitlines()
                      if line.startswith("| `-"))
    # A row's first cell names the option; its description may name mpiexec's own flags.
    documented = {o for row in table.splitlines()
                  for o in re.findall(r"(--[a-z][a-z0-9-]*)", row.split(" | ")[0])}
    assert options - documented == set(), "run options missing from the README's table"
    assert documented - options == set(), "README table rows for options that do not exist"


def test_the_revisions_table_lists_every_revision():
    """operations.md's table of schema revisions names each one the code ships, in order."""
    from store.revisions import known_revisions
    text = (ROOT / "docs" / "operations.md").read_text()
    table = text[text.index("### Schema revisions"):]
    assert re.findall(r"^\| `(\d{4})` \|", table, re.M) == list(known_revisions())


def test_what_protocol_md_says_a_callable_gets_is_what_it_gets(tmp_path):
    """protocol.md §4 said `data` was "the argument of a `--callable`"; the callable is
    called with the whole payload (`{"data": …}`), as the README and running.md say."""
    from coordinator.executors import PythonExecutor
    from store.semantic import canonical_form
    module = tmp_path / "echo.py"
    module.write_text("def one(task):\n    return task\n\n"
                      "def two(task, input_bytes):\n    return [task, input_bytes is None]\n")
    payload = {"data": {"n": 42}}
    task = json.loads(canonical_form(payload)[0])  # what a WORK carries
    got = PythonExecutor(f"{module}:one").run(task, None, tmp_path)
    assert got.status == "ok" and got.value == payload  # not {"n": 42}
    got = PythonExecutor(f"{module}:two").run(task, None, tmp_path)
    assert got.value == [payload, True]
    text = (ROOT / "docs" / "protocol.md").read_text()
    [row] = [line for line in text.splitlines() if line.startswith("| `data` |")]
    assert "called with the whole payload, `{\"data\": …}`" in row, row
    assert "the argument of a `--callable`" not in text
