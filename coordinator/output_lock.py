"""One campaign per output directory: the master's lock on where its test cases go.

Two campaigns (two databases) writing into one AFL instance directory each number their test
cases from the same id, so its queue held `id:000002` twice, with different contents; AFL's
sync imports only from the id its counter names onwards, and so never imported one of the two
campaigns' lower ids. Into one plain `--out` directory the names do not collide (they are
digests of the contents), but a starting master removes the temp files a killed one left
there (`TestcaseWriter.scan`), which would be the other campaign's writes in progress.

So a master holds an exclusive `flock` on `.coordinator.lock` in that directory for its whole
life: in the AFL instance directory `DIR/NAME/` (the unit AFL keys its per-instance counters
by), beside its `queue/`, where AFL's sync, which reads `*/queue/` and skips dot names, never
looks; in the `--out` directory itself, whose dot files the writer skips. The kernel drops the
lock when the master ends, however it ends (`kill -9` included), so a campaign resumed after a
crash never meets a stale lock. The file is left in place: removing it would race with the
next master's open (two masters could then lock two files of one name). It holds the holder's
pid, host and `--db`, for the refusal of the next one; only the `flock` says whether one runs.

The stdlib only: `coordinator run` checks this before it launches MPI (`preflight`).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import socket
import sys
import time
from pathlib import Path

from .errors import OutputInUseError

LOCK_NAME = ".coordinator.lock"

#: How long a master retries a lock it finds taken before it refuses: the check before MPI
#: (`check_free`) takes it for an instant, and may do so just as a master of another start
#: asks for it.
TAKEN_RETRY_S = 1.0


class OutputLock:
    """The held lock: an open descriptor with the `flock`. `release` (or the process's end)
    lets the next master have the directory."""

    def __init__(self, fd: int | None, path: Path, made: tuple[Path, ...] = ()) -> None:
        self.fd: int | None = fd
        self.path = path
        self.made = made  # the directories this lock made, deepest first

    def release(self, *, undo: bool = False) -> None:
        """`undo`: a start that is refused leaves nothing behind: the lock file and the
        directories it made go, if nothing else was put there. (A master that has opened the
        file meanwhile finds it no longer named once it gets the lock, and makes another.)"""
        if undo and self.fd is not None:
            with contextlib.suppress(OSError):
                self.path.unlink()
            for d in self.made:
                with contextlib.suppress(OSError):
                    d.rmdir()  # (fails if anything is there: kept)
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def lock_output(directory: Path, flag: str, *, db: Path) -> OutputLock:
    """Hold `directory` (made if it is not there yet) for the master of the campaign in `db`;
    OutputInUseError while another process holds it. `flag` is the option that chose the
    directory (`--name`, `--out`): what the refusal tells the user to change."""
    directory = Path(directory)
    made = tuple(d for d in (directory, *directory.parents) if not d.exists())
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / LOCK_NAME
    deadline = time.monotonic() + TAKEN_RETRY_S
    while True:
        fd, writable = _open(path)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            if time.monotonic() < deadline:
                time.sleep(0.05)
                continue
            raise _in_use(directory, path, db, flag) from None
        except OSError as e:
            # A filesystem without `flock` (Lustre mounted `noflock`, some NFS setups: ENOLCK,
            # EOPNOTSUPP): refusing would stop every campaign there, resumes included, for a
            # guard against a mistake. Said, and the run goes on without it.
            os.close(fd)
            print(f"coordinator: cannot lock {directory} ({e.strerror or e}): another "
                  f"campaign's master writing there would not be refused; give each campaign "
                  f"its own {flag}", file=sys.stderr, flush=True)
            return OutputLock(None, path, made)
        except BaseException:
            os.close(fd)
            raise
        if _still_named(fd, path):
            break
        # The directory was removed or the file replaced between the open and the lock: a
        # lock on a file no name reaches would hold nobody off.
        os.close(fd)
    if writable:
        record = json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                             "db": str(Path(db).absolute())})
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, (record + "\n").encode(), 0)
        except OSError:
            pass  # (a full disk: the lock holds all the same; the refusal names no holder)
    return OutputLock(fd, path, made)


def check_free(directory: Path, flag: str, *, db: Path) -> None:
    """OutputInUseError if a master holds `directory` now. Creates nothing: no directory, no
    lock file (a start refused later leaves nothing behind); the lock is taken and dropped
    at once, shared, so that it also tells on a filesystem whose locks `/proc` does not list."""
    path = Path(directory) / LOCK_NAME
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError:
        return  # none yet (or none this user may read: the master's own open will tell)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        raise _in_use(Path(directory), path, db, flag) from None
    except OSError:
        return
    finally:
        os.close(fd)


def _open(path: Path) -> tuple[int, bool]:
    """The lock file, for writing its record if this user may, else for the lock alone (a
    file another user's master made). Never through a symbolic link put in its place."""
    flags = os.O_CLOEXEC | os.O_NOFOLLOW
    try:
        return os.open(path, os.O_RDWR | os.O_CREAT | flags, 0o644), True
    except OSError as e:
        if e.errno not in (errno.EACCES, errno.EPERM, errno.EROFS):
            raise
    return os.open(path, os.O_RDONLY | flags), False


def _still_named(fd: int, path: Path) -> bool:
    try:
        named, held = os.stat(path, follow_symlinks=False), os.fstat(fd)
    except OSError:
        return False
    return (named.st_dev, named.st_ino) == (held.st_dev, held.st_ino)


def holder(path: Path) -> dict:
    """What the holder wrote in the lock file: its pid, host and --db, as far as readable."""
    try:
        with open(path, "rb") as f:
            record = json.loads(f.read(4096))
    except (OSError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}


def _in_use(directory: Path, path: Path, db: Path, flag: str) -> OutputInUseError:
    found = holder(path)
    pid, host, their_db = found.get("pid"), found.get("host"), found.get("db")
    who = ", ".join(part for part in (
        f"pid {pid}" if isinstance(pid, int) else "",
        f"on {host}" if isinstance(host, str) and host != socket.gethostname() else "",
        f"--db {their_db}" if isinstance(their_db, str) else "") if part)
    stop = f" (`kill -TERM {pid}` stops it gracefully)" if isinstance(pid, int) else ""
    if isinstance(their_db, str) and _same_file(their_db, db):
        return OutputInUseError(
            f"{directory} is in use by a master of this campaign ({who}); stop it first{stop}")
    why = ("AFL's sync would import only one campaign's test cases (both would number theirs "
           "from the same id)" if flag == "--name" else
           "each master would remove the other's test cases being written")
    return OutputInUseError(
        f"{directory} is in use by another campaign's master"
        + (f" ({who})" if who else "")
        + f": two campaigns cannot write their test cases to one directory, {why}; give this "
          f"campaign its own directory with another {flag}, or stop that master first{stop}")


def _same_file(a: str, b: Path) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return os.path.realpath(a) == os.path.realpath(b)
