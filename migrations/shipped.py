"""What a revision shipped, for a later one to go back to: a revision's file never changes once
shipped, so a later revision's downgrade reads the definition from it rather than copying it."""

from __future__ import annotations

import importlib.util
from pathlib import Path


def shipped_view(revision_file: str, name: str) -> str:
    """The view `name` as the revision in `revision_file` (a file of migrations/versions)
    defined it, in its `VIEWS`."""
    path = Path(__file__).with_name("versions") / revision_file
    spec = importlib.util.spec_from_file_location(f"_revision_{path.stem}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.VIEWS[name]
