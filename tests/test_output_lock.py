"""One campaign per output directory (coordinator/output_lock.py): a second campaign's master
is refused the directory another one writes its test cases to, before MPI starts and again in
the master; a master that died (kill -9) leaves no lock behind. The holder here is a real
process of its own: a lock this process held would not show what another master sees."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from fakes import VerdictTransport

from coordinator import master_rank
from coordinator.cli import _parser
from coordinator.config import resolve_run
from coordinator.errors import OutputInUseError
from coordinator.exits import ExitStatus
from coordinator.output import TestcaseWriter
from coordinator.output_lock import LOCK_NAME, check_free, lock_output
from coordinator.preflight import check_run

ROOT = Path(__file__).resolve().parent.parent

HOLDER = textwrap.dedent("""\
    import sys, time
    from pathlib import Path
    from coordinator.output_lock import lock_output
    lock_output(Path(sys.argv[1]), sys.argv[2], db=Path(sys.argv[3]))
    print("held", flush=True)
    time.sleep(120)
    """)


class Holder:
    """Another process holding `directory` as a master of the campaign in `db` does."""

    def __init__(self, directory: Path, db: Path, flag: str = "--name") -> None:
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        self.proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(directory), flag,
                                      str(db)], stdout=subprocess.PIPE, text=True, env=env)
        assert self.proc.stdout is not None
        assert self.proc.stdout.readline() == "held\n"

    def kill(self) -> None:
        """As `kill -9` ends a master: nothing of its own code runs."""
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=30)

    def __enter__(self) -> Holder:
        return self

    def __exit__(self, *exc) -> None:
        if self.proc.poll() is None:
            self.kill()


def config(db: Path, *args: str):
    return resolve_run(_parser().parse_args(["run", "--db", str(db), *args]))


def afl_campaign(tmp_path: Path, db: Path, fuzzer: str, *more: str):
    target = tmp_path / "t.sh"
    target.write_text("#!/bin/sh\n")
    target.chmod(0o755)
    (tmp_path / "afl" / fuzzer / "queue").mkdir(parents=True, exist_ok=True)
    return config(db, "--afl-out", str(tmp_path / "afl"), "--fuzzer", fuzzer, *more, "--",
                  str(target), "@@")


@pytest.mark.timeout(60)
def test_a_second_campaign_is_refused_the_afl_instance_directory_another_writes(tmp_path):
    """Two campaigns with the default --name symcc wrote one queue: id:000002 to id:000011
    twice each, and AFL's sync never imported one campaign's lower ids."""
    instance = tmp_path / "afl" / "symcc"
    first_db, second_db = tmp_path / "ct1.db", tmp_path / "ct2.db"
    second = afl_campaign(tmp_path, second_db, "sec")
    with Holder(instance, first_db) as holder:
        pid = holder.proc.pid
        for refusal in (lambda: check_run(second),  # before MPI
                        lambda: lock_output(instance, "--name", db=second_db)):  # the master's
            with pytest.raises(OutputInUseError) as e:
                refusal()
            said = str(e.value)
            assert said.startswith(f"{instance} is in use by another campaign's master (pid "
                                   f"{pid}, --db {first_db}): ")
            assert "another --name" in said and f"kill -TERM {pid}" in said
        assert not second_db.exists()
    # Its own queue stays AFL's to read: the lock is beside it, a dot file AFL's sync skips.
    assert sorted(p.name for p in instance.iterdir()) == [LOCK_NAME]


@pytest.mark.timeout(60)
def test_a_master_killed_with_sigkill_leaves_no_stale_lock(tmp_path):
    """The same campaign resumed after a crash is not refused: the kernel dropped the lock
    with the process, whatever the file beside still says."""
    instance, db = tmp_path / "afl" / "symcc", tmp_path / "ct1.db"
    with Holder(instance, db) as holder:
        dead = holder.proc.pid
        holder.kill()
    assert json.loads((instance / LOCK_NAME).read_text())["pid"] == dead
    check_free(instance, "--name", db=db)
    held = lock_output(instance, "--name", db=db)
    try:
        assert json.loads((instance / LOCK_NAME).read_text()) == {
            "pid": os.getpid(), "host": os.uname().nodename, "db": str(db)}
    finally:
        held.release()


@pytest.mark.timeout(60)
def test_two_campaigns_are_refused_one_out_directory(tmp_path):
    """Plain names do not collide (digests), but a master's start removes the temp files a
    killed one left there: another campaign's writes in progress."""
    out, first_db, second_db = tmp_path / "shared", tmp_path / "a.db", tmp_path / "b.db"
    with Holder(out, first_db, "--out") as holder, pytest.raises(OutputInUseError) as e:
        check_run(config(second_db, "--demo", "3", "--out", str(out)))
    assert f"(pid {holder.proc.pid}, --db {first_db}): " in str(e.value)
    assert "remove the other's test cases being written" in str(e.value)
    assert "another --out" in str(e.value)
    # The lock file stays through the next master's start, whose writer cleans up beside it.
    written = TestcaseWriter(out, afl_style=False).write(b"x", "t")
    assert written is not None
    assert sorted(p.name for p in out.iterdir()) == [LOCK_NAME, written.name]


@pytest.mark.timeout(60)
def test_a_master_that_passed_the_check_with_another_is_refused_and_changes_nothing(
        tmp_path, monkeypatch):
    """Two campaigns started at once both pass the check before MPI: the second master to ask
    for the directory is refused (exit 2, every worker told), before its database is made."""
    instance, second_db = tmp_path / "afl" / "symcc", tmp_path / "ct2.db"
    cfg = afl_campaign(tmp_path, second_db, "sec")
    with Holder(instance, tmp_path / "ct1.db"):
        # The check as it went when the other master had not taken the directory yet.
        monkeypatch.setattr("coordinator.preflight.check_free", lambda *a, **k: None)
        transport = VerdictTransport()
        status = master_rank.MasterRank(cfg, transport).run()
    assert status == ExitStatus.USAGE and transport.verdicts == [ExitStatus.USAGE]
    assert not second_db.exists()


@pytest.mark.timeout(60)
def test_the_self_launcher_refuses_a_held_directory_before_it_runs_mpiexec(tmp_path):
    ran = tmp_path / "mpiexec-ran"
    mpiexec = tmp_path / "mpiexec"
    mpiexec.write_text(f"#!/bin/sh\ntouch {ran}\nexit 0\n")
    mpiexec.chmod(0o755)
    (tmp_path / "afl" / "sec" / "queue").mkdir(parents=True)
    (tmp_path / "t.sh").write_text("#!/bin/sh\n")
    (tmp_path / "t.sh").chmod(0o755)
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("OMPI_COMM_WORLD", "PMI", "PMIX", "HYDRA", "MPI_LOCAL"))}
    with Holder(tmp_path / "afl" / "symcc", tmp_path / "ct1.db"):
        done = subprocess.run([sys.executable, "-m", "coordinator", "run", "--db", "ct2.db",
                               "--mpiexec", str(mpiexec), "--afl-out", "afl", "--fuzzer", "sec",
                               "--", "./t.sh", "@@"], capture_output=True, text=True,
                              timeout=60, cwd=tmp_path, env=env)
    assert done.returncode == ExitStatus.USAGE, done.stderr
    assert done.stderr.startswith("coordinator: afl/symcc is in use by another campaign's "
                                  "master (pid ") and len(done.stderr.splitlines()) == 1
    assert not ran.exists() and not (tmp_path / "ct2.db").exists()


def test_a_filesystem_without_flock_warns_and_runs_instead_of_refusing(tmp_path, monkeypatch,
                                                                       capsys):
    """On a filesystem whose `flock` fails (Lustre mounted `noflock`, some NFS setups: ENOLCK)
    every start, resumes included, was refused as if another campaign held the directory.
    The lock guards against a mistake: without it the master says so and runs."""
    import errno
    import fcntl

    def no_locks(fd, op):
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))

    monkeypatch.setattr(fcntl, "flock", no_locks)
    check_free(tmp_path / "out", "--out", db=tmp_path / "c.db")  # (nothing there yet)
    held = lock_output(tmp_path / "out", "--out", db=tmp_path / "c.db")
    assert held.fd is None
    held.release()
    assert (f"coordinator: cannot lock {tmp_path / 'out'} (No locks available): another "
            f"campaign's master writing there would not be refused") in capsys.readouterr().err
