"""One master per campaign *file*: the lock is the file's own, whatever its name.

A master holds an exclusive `flock` on the database file itself for its whole life (released
when the process ends, however it ends). A lock kept in a file beside it (`NAME.lock`) would
follow the name: through a hard link a second master could take a lock of its own on the same
campaign, start its own `-wal`, and a later command on that name apply the stale WAL to the
shared file. `flock` locks the inode, so every name of the file shares one lock; and a file with
more than one name is refused anyway (`refuse_aliases`). SQLite's own locks are POSIX record
locks, which Linux keeps apart from `flock`s on local filesystems (network ones are refused).

Versions before this lock (schema revision 0008 and older) held `flock` on `REALPATH.lock`
instead. Such a master does not hold the file's own lock, so while that sidecar exists it is
tested and held too (`_hold_legacy_lock`, `lock_holder`): an operator who upgrades between a
start and a `--resume` may have left the older version running on the same file.

Light: the stdlib only, for the checks `coordinator run` makes before it launches MPI.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
from collections.abc import Iterator
from pathlib import Path

from .errors import CampaignLockedError, DatabaseOpenError, ReadOnlyDatabaseError


def refuse_aliases(path: str | os.PathLike[str]) -> None:
    """One campaign file, one name. SQLite keeps a `-wal` and a `-shm` per *name*: two names
    of one file can hold two masters (under another lock scheme), and a command on one name
    can apply a WAL left by the other to the shared file (1,500 done tasks became 1,172, and
    an index went wrong)."""
    try:
        st = os.stat(path)
    except OSError:
        return
    if st.st_nlink > 1 and not os.path.isdir(path):
        raise DatabaseOpenError(
            f"{path} has {st.st_nlink} names (hard links to one file): SQLite keeps a -wal per "
            f"name, so a command on one name could apply another name's WAL to the shared file "
            f"and undo commits; keep one name (list them with `find / -xdev -samefile {path}`) "
            f"and remove the others")


def refuse_read_only(path: str | os.PathLike[str]) -> None:
    """Refuse, before anything is opened for writing, a campaign file that a write command (a
    run, `requeue`, `db upgrade`) could not write as SQLite needs: the file itself, its `-wal`
    and `-shm` where they exist, and its directory where one of them is still to be made.
    Asked here, once, so that the refusal is one message whichever of those exist: what
    failed first differed (SQLite's switch to WAL without a -wal, the first write with one,
    the lock's open). access(2) answers for root too: a read-only mount (EROFS) and an
    immutable file (EPERM) bind it where modes do not."""
    named = Path(path).absolute()
    real = Path(os.path.realpath(named))
    if not real.parent.is_dir():
        return  # (the caller says the directory is missing)
    if real.exists():
        if not os.access(real, os.W_OK):
            raise read_only(named, _why_not_writable(real, "the file"))
        for side in ("-wal", "-shm"):
            beside = real.with_name(real.name + side)
            if beside.exists() and not os.access(beside, os.W_OK):
                raise read_only(named, _why_not_writable(beside, f"{beside.name} beside it"))
        if all(real.with_name(real.name + side).exists() for side in ("-wal", "-shm")):
            return
    if not os.access(real.parent, os.W_OK | os.X_OK):
        what = (f"its directory {real.parent}, where SQLite makes {real.name}-wal and "
                f"{real.name}-shm," if real.exists() else f"its directory {real.parent}")
        raise read_only(named, _why_not_writable(real.parent, what), new=not real.exists())


def _why_not_writable(path: Path, what: str) -> str:
    try:
        on_read_only_fs = bool(os.statvfs(path).f_flag & os.ST_RDONLY)
    except OSError:
        on_read_only_fs = False
    if on_read_only_fs:
        return f"{what} is on a read-only filesystem"
    kind = "directory" if path.is_dir() else "file"
    return (f"{what} cannot be written (its mode, or an immutable {kind}: `lsattr -d {path}` "
            f"shows an i)")


def read_only(path: Path, why: str, *, new: bool = False) -> ReadOnlyDatabaseError:
    """The one refusal of a write command on a file it cannot write, whichever of the file,
    its side files or its directory stops it."""
    if new:
        return ReadOnlyDatabaseError(
            f"{path} cannot be created: {why}; choose a --db path in a writable node-local "
            f"directory")
    return ReadOnlyDatabaseError(
        f"{path} is read-only: {why}. This command writes to the campaign: copy {path.name} "
        f"and its -wal, if there is one, to a writable node-local directory and run it on the "
        f"copy; `coordinator status` and `coordinator check` read the file where it is")


def lock_campaign(path: str | os.PathLike[str]) -> int:
    """Hold the campaign file's lock: an open descriptor of the file (created empty if it is
    not there yet: a new campaign) with an exclusive `flock`. Close it, after the database's
    own connections, to release the campaign. CampaignLockedError while another process
    holds it."""
    refuse_aliases(path)
    refuse_read_only(path)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o644)
    except OSError as e:
        if e.errno not in (errno.EACCES, errno.EPERM, errno.EROFS):
            raise
        # (What access(2) allowed and open(2) refused: a security module, say.)
        raise read_only(Path(path).absolute(), f"it cannot be opened for writing "
                                               f"({e.strerror})",
                        new=not os.path.exists(path)) from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        holder = lock_holder(path)
        raise CampaignLockedError(
            f"{path} is in use by another master"
            + (f" (pid {holder})" if holder else "")
            + " or by a `coordinator db upgrade`; stop it first"
            + (f" (`kill -TERM {holder}` stops a master gracefully)" if holder else "")
            + ", or choose another --db path") from None
    except BaseException:
        os.close(fd)
        raise
    legacy = None
    try:
        legacy = _hold_legacy_lock(path)
        refuse_aliases(path)  # (a link made while it was being opened)
    except BaseException:
        if legacy is not None:
            os.close(legacy)
        os.close(fd)
        raise
    _held[fd] = os.path.realpath(path)
    if legacy is not None:
        _legacy_held[fd] = legacy
    return fd


def _legacy_lock_path(path: str | os.PathLike[str]) -> Path:
    """The lock file of versions at revision 0008 and older (`NAME.lock` beside the real file)."""
    return Path(os.path.realpath(path) + ".lock")


def _hold_legacy_lock(path: str | os.PathLike[str]) -> int | None:
    """Hold the older versions' lock too, if its file exists: measured, an older master
    still running on the file was reported "not running" by `status`, `db upgrade` changed
    the schema under it, and a `--resume` started a second master that charged its in-flight
    tasks. The file is never created (no older master can start on a file at this revision:
    it refuses the newer schema); the descriptor, or None where there is none to hold."""
    lock = _legacy_lock_path(path)
    try:
        # Read-only: `flock` needs no write access, and the older versions made it 0644, so
        # another user's master left one this process may not open for writing.
        fd = os.open(lock, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        return None  # (the usual case)
    except OSError as e:
        raise CampaignLockedError(
            f"{path} has an older coordinator version's lock file {lock}, which cannot be "
            f"read ({e.strerror}): whether a master of that version runs on it cannot be "
            f"told; if none does, remove {lock}") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        # The kernel's holder, not the pid written in the file: an older `db upgrade` held
        # it without writing its own, so the file can name a master long gone.
        pid = _flock_holder(lock)
        raise CampaignLockedError(
            f"{path} is in use by a master (or a `db upgrade`) of an older coordinator "
            f"version" + (f" (pid {pid})" if pid else "")
            + f", which holds {lock}; stop it first"
            + (f" (`kill -TERM {pid}` stops a master gracefully)" if pid else "")
            + ", then --resume it with this version") from None
    except BaseException:
        os.close(fd)
        raise
    return fd


#: The campaign files this process holds (`lock_campaign`), by descriptor: their real paths.
_held: dict[int, str] = {}
#: The older versions' lock files held with them (`_hold_legacy_lock`), by the same descriptor.
_legacy_held: dict[int, int] = {}

#: What SQLite keeps beside a database, by the database's real name.
SIDE_FILES = ("-wal", "-shm", "-journal")


def same_file(a: str | os.PathLike[str], b: str | os.PathLike[str]) -> bool:
    """Whether two paths name one file: the same path once links are resolved (whether or
    not it exists yet), or the same inode (a hard link)."""
    if os.path.realpath(a) == os.path.realpath(b):
        return True
    try:
        return os.path.samefile(a, b)
    except OSError:  # one of them does not exist: not the same one
        return False


def lost_name(fd: int) -> str | None:
    """Whether the campaign file held by `fd` still has its name: None if so, else what became
    of it. A `rm` (or a /tmp cleaner, or a `mv` of another file over it) leaves a master
    writing to a file no name reaches: everything it commits is lost when it closes, and a
    second master could start on the name meanwhile (the lock is on the old file)."""
    path = _held.get(fd)
    if path is None:
        return None
    try:
        named, held = os.stat(path), os.fstat(fd)
    except FileNotFoundError:
        return f"{path} was removed"
    if (named.st_dev, named.st_ino) != (held.st_dev, held.st_ino):
        return f"{path} was replaced by another file"
    return None


def release_campaign(fd: int) -> None:
    """Close the descriptor `lock_campaign` returned (after the database's own connections:
    closing a descriptor of the file drops the process's POSIX locks on it, SQLite's)."""
    _held.pop(fd, None)
    legacy = _legacy_held.pop(fd, None)
    if legacy is not None:
        os.close(legacy)
    os.close(fd)


def held_campaign_file(path: str | os.PathLike[str]) -> str | None:
    """The campaign this process holds that `path` is a file of (the database, its -wal,
    -shm or -journal, by any name), or None. Such a file is read and written only through
    SQLite while held: opening and closing it otherwise would drop SQLite's POSIX locks (on
    the database: the next process to close it would delete the -wal under the master)."""
    for db in _held.values():
        if any(same_file(path, db + side) for side in ("", *SIDE_FILES)):
            return db
    return None


def held_file_ids() -> frozenset[tuple[int, int]]:
    """(device, inode) of each file of the campaigns this process holds that exists now: a
    directory's entries are checked against it by their own `stat`, a hard link included,
    without a lookup of each entry's name (`held_campaign_file`)."""
    ids = set()
    for db in _held.values():
        for side in ("", *SIDE_FILES):
            try:
                st = os.stat(db + side)
            except OSError:
                continue
            ids.add((st.st_dev, st.st_ino))
    return frozenset(ids)


@contextlib.contextmanager
def campaign_locked(path: str | os.PathLike[str]) -> Iterator[None]:
    """Hold the campaign's lock (as a master does) for a maintenance step that must not run
    under a master, like a schema upgrade; CampaignLockedError while one runs. The file must
    exist: nothing is created for a step on a file that is not there."""
    if not os.path.exists(path):
        yield
        return
    fd = lock_campaign(path)
    try:
        yield
    finally:
        release_campaign(fd)


def lock_holder(path: str | os.PathLike[str]) -> int | None:
    """The pid of the process on this host that holds the campaign file's lock now (a master,
    or a `db upgrade`), from the kernel's table of locks (Linux `/proc/locks`: no pid to be
    reused, nothing taken); None if none does, or it cannot be told (no /proc)."""
    # The file's own lock, then that of an older version's master (`_hold_legacy_lock`).
    return _flock_holder(path) or _flock_holder(_legacy_lock_path(path))


def _flock_holder(path: str | os.PathLike[str]) -> int | None:
    try:
        st = os.stat(path)
        table = Path("/proc/locks").read_text()
    except OSError:
        return None
    ours = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    for line in table.splitlines():
        f = line.split()
        # "1: FLOCK  ADVISORY  WRITE 1234 fe:00:5678 0 EOF"
        if len(f) >= 6 and f[1] == "FLOCK" and f[5] == ours and f[4].isdigit():
            return int(f[4])
    return None


def locks_readable() -> bool:
    """Whether `lock_holder` can tell at all (it reads Linux's /proc/locks)."""
    return os.access("/proc/locks", os.R_OK)
