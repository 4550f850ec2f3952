"""tools/make_venv.py refuses what would destroy or fail late, before creating anything."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

TOOL = Path(__file__).resolve().parent.parent / "tools" / "make_venv.py"


def make_venv(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(TOOL), *args], capture_output=True, text=True,
                          timeout=120, env=env, check=False)


def test_a_directory_that_is_not_a_venv_is_never_emptied(tmp_path):
    precious = tmp_path / "precious"
    precious.mkdir()
    (precious / "notes.txt").write_text("keep me")
    done = make_venv(str(precious))
    assert done.returncode != 0
    assert "is not a virtual environment" in done.stderr
    assert (precious / "notes.txt").read_text() == "keep me"


@pytest.mark.skipif(any((Path(d) / "mpicc").exists() for d in ("/usr/bin", "/bin")),
                    reason="this machine has a system mpicc")
def test_system_mpi_without_mpicc_says_so_at_once(tmp_path):
    env = {**os.environ, "PATH": "/usr/bin:/bin"}
    done = make_venv("--mpi", "system", str(tmp_path / "v"), env=env)
    assert done.returncode != 0
    assert "no mpicc on PATH" in done.stderr
    assert not (tmp_path / "v").exists()
