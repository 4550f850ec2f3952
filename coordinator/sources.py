"""Where tasks come from, on the master.

Sources only *find* work and return semantic payloads; the caller decides what to enqueue (the
store deduplicates by semantic id, so returning a task twice across restarts is harmless).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import pathlib
import signal
import stat
import sys
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import IO, Any

from store.lock import held_campaign_file, held_file_ids
from store.semantic import PayloadError, canonical_form
from store.tasks import NewTask

from .errors import UsageError

__all__ = [
    "AflQueueSource",
    "NewInput",
    "SEMANTIC_FIELDS",
    "TASK_FILE_FIELDS",
    "TaskFileError",
    "TasksFile",
    "afl_queue_missing",
    "demo_tasks",
    "load_tasks_jsonl",
]

# The semantic payload fields of a task (docs/protocol.md §4, plus `data` for generic farms).
SEMANTIC_FIELDS = frozenset(
    {"path", "data", "focus_bytes", "target_branch", "s2f_actions", "schedule_prefix",
     "continuation"}
)
# What a line of a tasks file may hold: the semantic fields plus where to read the input from.
TASK_FILE_FIELDS = SEMANTIC_FIELDS | {"input_file"}


@dataclass(frozen=True)
class NewInput:
    payload: dict
    input_bytes: bytes | None
    origin: str
    canonical: tuple[str, str] | None = None  # canonical_form(payload), if already computed

    def as_task(self) -> NewTask:
        """The task to enqueue: the canonical form computed while checking the input travels
        with it, so the import does not encode the payload again."""
        return NewTask(self.payload, self.input_bytes, origin=self.origin,
                       canonical=self.canonical)


# --------------------------------------------------------------------------------------------
# AFL queue
# --------------------------------------------------------------------------------------------


class AflQueueSource:
    """Watches ``afl_out/<fuzzer>/queue/`` for new ``id:*`` entries.

    AFL writes a queue entry in place (open(O_CREAT|O_EXCL), write, close; no rename), so a
    file is only taken once it has settled: its mtime is at least ``settle_s`` old, it did not
    change since a previous poll saw it, and no process holds it open for writing (asked with a
    read lease, which the kernel refuses while a writer has the file open). Where no lease can
    be asked (another user's file without CAP_LEASE, NFS), a poll must find it as the previous
    one did: the age alone let a writer that paused mid-file have its first half taken.
    (An mtime in the future: unchanged since the previous poll.)
    Names already handled are remembered, so a poll stats only names it has not finished with.
    The queue is listed again only when the directory changed (its mtime): listing a
    40,000-entry queue takes 21-30 ms, and a poll comes every second, for ever.
    """

    #: A listing is trusted this long at most, whatever the directory's mtime says.
    RELIST_S = 60.0
    #: A directory changed less than this before it was listed may change again within the
    #: same tick of the filesystem's clock, without a new mtime: its listing is not trusted.
    #: (Ticks: ~4 ms on ext4 and XFS, 1 s on ext3, 2 s on FAT.)
    QUIET_S = 2.5

    def __init__(self, afl_out: pathlib.Path, fuzzer: str, settle_s: float = 0.5) -> None:
        if not fuzzer or "/" in fuzzer or fuzzer in (".", ".."):
            raise UsageError(f"fuzzer name {fuzzer!r} must be a single directory name, like 'main'")
        if not settle_s >= 0:
            raise ValueError(f"settle time must be >= 0 seconds, got {settle_s!r}")
        self.fuzzer = fuzzer
        self.queue_dir = (pathlib.Path(afl_out) / fuzzer / "queue").absolute()
        self.settle_s = float(settle_s)
        self._handled: set[str] = set()
        # name -> (size, mtime_ns) seen by the previous poll, for files not settled yet
        self._unsettled: dict[str, tuple[int, int]] = {}
        self._seen_hashes: set[str] = set()
        self._unreadable = ""  # the last reason the queue could not be read, said once
        # (inode, mtime_ns) of the queue directory when it was last listed, if trusted
        self._listed: tuple[int, int] | None = None
        self._relist_at = 0.0
        #: Entries that are not regular files (symbolic links, pipes, ...) or are files of
        #: the campaign's database: never read.
        self.skipped = 0
        #: Entries that could not be read (AFL++ writes them 0600: a coordinator running as
        #: another user reads none of them), retried at every poll, said for the first few.
        self._cannot_read: set[str] = set()
        self._said_held_open: set[str] = set()  # (`_say_held_open`)
        self._campaign_files: frozenset[tuple[int, int]] = frozenset()  # (dev, ino), a poll's

    @property
    def origin_prefix(self) -> str:
        """What the `origin` of every task this source made starts with."""
        return f"afl:{self.fuzzer}/"

    def remember(self, origins: Iterable[str]) -> None:
        """Names handled in an earlier run (the origins of the tasks they made): after a
        restart they are neither read nor hashed again (4.4 s for a 40,000-entry queue,
        before a new entry could be dispatched)."""
        n = len(self.origin_prefix)
        self._handled.update(o[n:] for o in origins if o.startswith(self.origin_prefix))

    def poll(self) -> list[NewInput]:
        names = self._new_names()
        if names is None:
            return []
        now = time.time()
        found: list[NewInput] = []
        still_unsettled: dict[str, tuple[int, int]] = {}
        self._campaign_files = held_file_ids()
        for name in sorted(names):
            new_input = self._take(name, now, still_unsettled)
            if new_input is not None:
                found.append(new_input)
        # Names that vanished before settling are forgotten, so a later file of that name is new.
        self._unsettled = still_unsettled
        return found

    def _new_names(self) -> list[str] | None:
        try:
            # Before the listing: a change made during it moves the mtime past this one.
            st = os.stat(self.queue_dir)
            now, tick = time.time(), time.monotonic()
            if self._listed == (st.st_ino, st.st_mtime_ns) and tick < self._relist_at:
                return list(self._unsettled)  # nothing added or removed since
            with os.scandir(self.queue_dir) as it:
                names = []
                for entry in it:
                    if entry.name in self._handled:
                        continue
                    if not entry.name.startswith("id:"):
                        # Dot files, AFL's .state/ and anything else are never queue entries
                        # (an `id:` directory is, as any other entry not a regular file,
                        # skipped and said by `_take`).
                        self._handled.add(entry.name)
                        continue
                    names.append(entry.name)
            self._unreadable = ""  # readable again: a later outage is reported again
            quiet = now - st.st_mtime_ns / 1e9 >= self.QUIET_S
            self._listed = (st.st_ino, st.st_mtime_ns) if quiet else None
            self._relist_at = tick + self.RELIST_S
            return names
        except FileNotFoundError:
            # AFL has not created the queue yet. (A file where the queue or its instance
            # directory should be is not "yet": it is said below, once, like an unreadable
            # queue, instead of a wait for ever without a word.)
            return None
        except OSError as e:
            # Unreadable (AFL running as another user, an I/O error): say so once, keep
            # looking. Not the master's own output failing, which stops the run.
            why = f"{e.strerror or e}"
            if why != self._unreadable:
                self._unreadable = why
                print(f"coordinator: cannot read the AFL queue {self.queue_dir}: {why}; "
                      f"retrying", file=sys.stderr, flush=True)
            return None

    #: How many unreadable entries are said, each once (all of them may be: a queue of
    #: 40,000 entries of another user).
    SAY_UNREADABLE = 3

    def _say_unreadable(self, path: pathlib.Path, e: OSError) -> None:
        self._say_first(self._cannot_read, path, (
            f"cannot be read: {e.strerror or e}; retrying at each poll (AFL++ writes its "
            f"entries 0600: run the coordinator as the fuzzer's user)"), "unreadable entries")

    #: An entry left unwritten this long while some process keeps it open for writing is
    #: said (once, for the first few): waiting for it silently hid it for good when a stray
    #: tool, not AFL++, held it.
    SAY_HELD_OPEN_S = 60.0

    def _say_held_open(self, path: pathlib.Path, age: float) -> None:
        self._say_first(self._said_held_open, path, (
            f"is held open for writing by some process, unchanged for {age:.0f} s: it is "
            f"taken once that process closes it (`fuser` names it)"), "such entries")

    def _say_first(self, said: set[str], path: pathlib.Path, what: str, these: str) -> None:
        """`what` of the entry `path`, said once, for the first SAY_UNREADABLE entries of
        its kind (`said`): a queue of 40,000 entries may all be so."""
        if path.name in said:
            return
        said.add(path.name)
        n = len(said)
        if n <= self.SAY_UNREADABLE:
            print(f"coordinator: AFL queue entry {_as_text(path)} {what}"
                  + (f" (further {these} are not said)" if n == self.SAY_UNREADABLE else ""),
                  file=sys.stderr, flush=True)

    def _take(
        self, name: str, now: float, still_unsettled: dict[str, tuple[int, int]]
    ) -> NewInput | None:
        path = self.queue_dir / name
        try:
            st = os.lstat(path)  # the entry itself: a symbolic link is never followed
        except FileNotFoundError:
            return None
        except OSError as e:
            still_unsettled[name] = (-1, -1)  # unreadable for now; look again next poll
            self._say_unreadable(path, e)
            return None
        if not stat.S_ISREG(st.st_mode):
            # A symbolic link (as root, one to /etc/passwd would be read, stored in the
            # campaign and fed to the target), a directory, a pipe, a device: not a queue
            # entry AFL wrote.
            self._handled.add(name)
            self.skipped += 1
            print(f"coordinator: AFL queue entry {_as_text(path)} skipped: "
                  f"{_kind_of(st.st_mode)}, not a regular file ({self.skipped} skipped so far)",
                  file=sys.stderr, flush=True)
            return None
        if (st.st_dev, st.st_ino) in self._campaign_files:
            # A link to the campaign's own database (or its -wal, -shm): opening and closing
            # it here would drop SQLite's POSIX locks on it (store.lock.held_campaign_file).
            self._handled.add(name)
            self.skipped += 1
            print(f"coordinator: AFL queue entry {_as_text(path)} skipped: a file of the "
                  f"campaign's database ({self.skipped} skipped so far)", file=sys.stderr,
                  flush=True)
            return None
        if st.st_size > MAX_INPUT_BYTES:
            self._handled.add(name)
            print(f"coordinator: AFL queue entry {_as_text(path)} skipped: {_too_big(st)}",
                  file=sys.stderr, flush=True)
            return None
        observed = (st.st_size, st.st_mtime_ns)
        previous = self._unsettled.get(name)
        age = now - st.st_mtime
        # An mtime ahead of this clock (a seed AFL hard-linked from an archive with future
        # timestamps, a skewed NFS clock) would never grow old: such a file settles once a
        # poll finds it as the previous one did. It used to be never taken, and unsaid.
        settled = age >= self.settle_s if age >= 0 else previous == observed
        if not settled or (previous is not None and previous != observed):
            still_unsettled[name] = observed
            return None
        try:
            content = _read_regular(path, st, unchanged=previous == observed)
        except FileNotFoundError:
            return None
        except OSError as e:
            still_unsettled[name] = observed
            self._say_unreadable(path, e)
            return None
        if content is _BEING_WRITTEN:
            still_unsettled[name] = observed
            if age >= self.SAY_HELD_OPEN_S and previous == observed:
                self._say_held_open(path, age)
            return None
        if content is None:  # replaced by something else since its lstat: look again
            still_unsettled[name] = (-1, -1)
            return None
        if len(content) != st.st_size:
            still_unsettled[name] = (len(content), st.st_mtime_ns)  # grew while we read it
            return None
        self._handled.add(name)
        self._cannot_read.discard(name)
        digest = hashlib.sha256(content).hexdigest()
        if digest in self._seen_hashes:
            return None
        self._seen_hashes.add(digest)
        # A name that is not UTF-8 (not AFL's, but anyone can drop a file there) cannot be
        # stored as text: it is kept with its bytes escaped. The input's bytes are stored with
        # the task, so the escaped path is never opened.
        where = _as_text(path)
        payload = {"path": where}
        try:
            canonical = canonical_form(payload)
        except PayloadError as e:  # nothing else should fail; if it does, say so, go on
            print(f"coordinator: AFL queue entry {where} skipped: {e}", file=sys.stderr,
                  flush=True)
            return None
        return NewInput(payload=payload, input_bytes=content,
                        origin=f"afl:{self.fuzzer}/{_as_text(name)}",
                        canonical=canonical)


#: What `_read_regular` returns for a file that is still being written.
_BEING_WRITTEN = b"\0being written"


def _read_regular(path: pathlib.Path, seen: os.stat_result,
                  unchanged: bool = True) -> bytes | None:
    """The bytes of the regular file `path` as `lstat` saw it; None if the name now holds
    something else (swapped for a link between the two); `_BEING_WRITTEN` if a process has it
    open for writing, or opened it so while it was read, or if that cannot be asked and the
    file was not found `unchanged` by two polls. Opened without following a link, and without
    blocking on a pipe."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0))
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or (st.st_dev, st.st_ino) != (seen.st_dev, seen.st_ino):
            return None
        lease = _read_lease(fd)
        if lease is False or (lease is None and not unchanged):
            return _BEING_WRITTEN
        try:
            content = f.read(MAX_INPUT_BYTES + 1)
        finally:
            # Held across the read: a writer opening the file meanwhile (a trim rewriting it
            # in place, as AFL++ does with AFL_NO_UNLINK) waits in its open() until this
            # unlock, and breaks the lease, which says the bytes read may be outdated now.
            broken = bool(lease) and fcntl.fcntl(fd, fcntl.F_GETLEASE) != fcntl.F_RDLCK
            if lease:
                fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_UNLCK)
        return _BEING_WRITTEN if broken else content


def _read_lease(fd: int) -> bool | None:
    """A read lease on the file of `fd` (opened read-only), taken (True) or refused because
    some process holds the file open for writing (False): Linux grants one only when none
    does. None where no lease can be asked (not Linux, a file of another user without
    CAP_LEASE, a filesystem without leases such as NFSv3)."""
    setlease = getattr(fcntl, "F_SETLEASE", None)
    if setlease is None:
        return None
    try:
        # A writer opening the file while the lease is held makes the kernel signal us, by
        # default with SIGIO, whose default action ends the process: SIGURG's is to ignore
        # it.
        fcntl.fcntl(fd, fcntl.F_SETSIG, signal.SIGURG)
        fcntl.fcntl(fd, setlease, fcntl.F_RDLCK)
    except BlockingIOError:
        return False
    except OSError:
        return None
    return True


def _kind_of(mode: int) -> str:
    return ("a symbolic link" if stat.S_ISLNK(mode) else "a directory" if stat.S_ISDIR(mode)
            else "a named pipe" if stat.S_ISFIFO(mode)
            else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode)
            else "a socket" if stat.S_ISSOCK(mode) else "an entry of another kind")


def _as_text(path: str | os.PathLike[str]) -> str:
    """A file name as valid UTF-8 text: bytes that are not UTF-8 become `\\xNN` escapes."""
    return os.fsencode(path).decode("utf-8", "backslashreplace")


def afl_queue_missing(afl_out: pathlib.Path, fuzzer: str) -> str | None:
    """The start's note when the queue to watch is not there yet (AFL creates it when it
    starts): None if something is at that path, even something else, which the source itself
    reports once rather than being waited for."""
    queue = afl_out / fuzzer / "queue"
    if os.path.exists(queue):
        return None
    return (f"{queue} does not exist yet; waiting for it (is AFL running with -o {afl_out} "
            f"and -M/-S {fuzzer}?)")


# --------------------------------------------------------------------------------------------
# tasks file (JSON Lines)
# --------------------------------------------------------------------------------------------


class TaskFileError(UsageError):
    """A tasks file line that cannot become a task; the message names the file and line."""

    def __init__(self, path: os.PathLike[str] | str, lineno: int, reason: str) -> None:
        self.path = os.fspath(path)
        self.lineno = lineno
        self.reason = reason
        super().__init__(f"{self.path}:{lineno}: {reason}")


def _reject_constant(name: str) -> Any:
    # NaN/Infinity are not JSON, and a task's identity is canonical JSON without them.
    raise ValueError(f"{name} is not allowed in a task")


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    # json.loads would keep the last of two equal keys; a task that says two things is a typo.
    obj: dict[str, Any] = {}
    for key, value in pairs:
        if key in obj:
            raise ValueError(f"duplicate key {key!r}")
        obj[key] = value
    return obj


def _parse_line(path: pathlib.Path, lineno: int, raw: bytes,
                read_input: bool = True) -> NewInput | None:
    """The task on one line, None for a blank one. Without `read_input` an input_file is
    only checked (a regular file), not read."""
    try:
        # utf-8-sig on the first line: editors on some systems start the file with a BOM.
        text = raw.decode("utf-8-sig" if lineno == 1 else "utf-8")
    except UnicodeDecodeError:
        raise TaskFileError(path, lineno, "not valid UTF-8") from None
    if not text.strip():
        return None
    try:
        obj = json.loads(text, parse_constant=_reject_constant, object_pairs_hook=_unique_keys)
    except ValueError as exc:
        raise TaskFileError(path, lineno, f"not valid JSON ({exc})") from None
    except RecursionError:
        raise TaskFileError(path, lineno, "JSON nested too deeply") from None
    if not isinstance(obj, dict):
        raise TaskFileError(path, lineno, "not a JSON object")
    unknown = sorted(set(obj) - TASK_FILE_FIELDS)
    if unknown:
        raise TaskFileError(
            path, lineno,
            f"unknown key {unknown[0]!r} (allowed: {', '.join(sorted(TASK_FILE_FIELDS))})"
        )
    if "path" not in obj and "data" not in obj:
        raise TaskFileError(path, lineno, "a task needs 'path' or 'data'")
    if "path" in obj and (not isinstance(obj["path"], str) or not obj["path"]):
        raise TaskFileError(path, lineno, "'path' must be a non-empty string")
    payload = {k: v for k, v in obj.items() if k != "input_file"}
    try:
        canonical = canonical_form(payload)  # the store's own checks, where the line is known
    except (PayloadError, ValueError) as exc:  # e.g. a lone surrogate cannot be UTF-8
        raise TaskFileError(path, lineno, str(exc)) from None
    except RecursionError:
        raise TaskFileError(path, lineno, "payload nested too deeply") from None
    return NewInput(payload=payload, input_bytes=_read_input_file(path, lineno, obj, read_input),
                    origin=f"{path}:{lineno}", canonical=canonical)


#: An input is stored with its task: SQLite refuses a value over 1 GB, and the failed write
#: stopped the master (a tasks file's import, or every start while such an AFL entry waited).
MAX_INPUT_BYTES = 256 << 20


def _too_big(st: os.stat_result) -> str:
    return (f"{st.st_size:,} bytes, over the {MAX_INPUT_BYTES >> 20} MiB an input may have "
            f"(it is stored with its task)")


def _read_input_file(path: pathlib.Path, lineno: int, obj: dict,
                     read: bool = True) -> bytes | None:
    if "input_file" not in obj:
        return None
    input_file = obj["input_file"]
    if not isinstance(input_file, str) or not input_file:
        raise TaskFileError(path, lineno, "'input_file' must be a non-empty string")
    held = held_campaign_file(input_file)
    if held is not None:
        raise TaskFileError(path, lineno, f"input_file {input_file!r} is a file of the "
                                          f"campaign's database {held}, which no task reads")
    try:
        st = os.stat(input_file)
        if not stat.S_ISREG(st.st_mode):
            # A FIFO would block the start for ever, /dev/zero would fill the memory.
            raise TaskFileError(path, lineno, f"input_file {input_file!r} is not a regular file")
        if st.st_size > MAX_INPUT_BYTES:
            raise TaskFileError(path, lineno, f"input_file {input_file!r}: {_too_big(st)}")
        if not read:
            with open(input_file, "rb"):  # readable: opened, not read (the import reads it)
                return b""
        return pathlib.Path(input_file).read_bytes()
    except OSError as exc:
        raise TaskFileError(path, lineno, f"cannot read input_file {input_file!r}: "
                                          f"{exc.strerror or exc}") from None


def load_tasks_jsonl(path: os.PathLike[str] | str) -> TasksFile:
    """Checks one task per non-blank line; any bad line rejects the whole file.

    All-or-nothing, so a typo on line 900 does not leave 899 tasks half-enqueued. Relative
    ``path`` and ``input_file`` values are taken relative to the current directory. The file
    is checked here, holding nothing, and read again as it is imported (`TasksFile`).
    """
    tasks = TasksFile(pathlib.Path(path))
    if not len(tasks):
        # A campaign of nothing would still be a campaign: the corrected file would then be
        # refused without --resume.
        what = "is empty" if os.path.getsize(path) == 0 else "holds no tasks (only blank lines)"
        raise UsageError(f"tasks file {os.fspath(path)!r} {what}")
    return tasks


class TasksFile:
    """A checked tasks file, read line by line each time it is iterated: holding every task
    of it costs ~1.5 KB a line (773 MiB for 500,000 lines) before the first is imported.
    A file changed since its check (a generator still writing it, an edit) is refused when it
    is read again: its lines are not the ones checked and counted. Iterating checks each line
    again all the same: a bad line raises `TaskFileError` inside the import's transaction,
    which then imports nothing."""

    def __init__(self, path: pathlib.Path):
        self.path = path
        self._checked: tuple[int, ...] | None = None  # the file as it was checked
        self._count = sum(1 for _ in self._read(check_only=True))

    def __len__(self) -> int:
        return self._count

    @property
    def identity(self) -> tuple[int, ...]:
        """The file as it was checked (device, inode, size, modification time in ns)."""
        assert self._checked is not None
        return self._checked

    def __iter__(self) -> Iterator[NewInput]:
        return (task for task in self._read(check_only=False) if task is not None)

    @staticmethod
    def _identity(f: IO[bytes]) -> tuple[int, ...]:
        st = os.fstat(f.fileno())
        return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns

    def _read(self, check_only: bool) -> Iterator[NewInput | None]:
        try:
            f = open(self.path, "rb")  # noqa: SIM115 (closed by the generator's `with`)
        except OSError as exc:
            raise UsageError(f"cannot read tasks file {os.fspath(self.path)!r}: "
                             f"{exc.strerror or exc}") from None
        with f:
            seen = self._identity(f)
            if check_only:
                self._checked = seen
            elif seen != self._checked:
                raise UsageError(f"tasks file {os.fspath(self.path)!r} changed after it was "
                                 f"checked; nothing of it was imported")
            # Lines as bytes.splitlines() cuts them (\n, \r\n and a lone \r), numbered so.
            lines = (line for physical in f for line in physical.splitlines())
            for lineno, raw in enumerate(lines, start=1):
                task = _parse_line(self.path, lineno, raw, read_input=not check_only)
                if task is not None:
                    yield task
            if not check_only and self._identity(f) != self._checked:
                # Written to while it was imported: the import's one transaction is undone.
                raise UsageError(f"tasks file {os.fspath(self.path)!r} changed while it was "
                                 f"imported; nothing of it was imported")


# --------------------------------------------------------------------------------------------


class DemoTasks:
    """`--demo N`: N built-in tasks, each made as it is imported (held as a list, 200,000 of
    them would more than double an import's peak: 185 MiB against 83)."""

    def __init__(self, n: int, start: int = 0):
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"number of demo tasks must be a non-negative integer, got {n!r}")
        self.n, self.start = n, min(max(start, 0), n)  # `start`: the first ones are in

    def __len__(self) -> int:
        return self.n - self.start

    def __iter__(self) -> Iterator[NewInput]:
        return (NewInput(payload={"data": {"n": i}}, input_bytes=None, origin="demo")
                for i in range(self.start, self.n))


demo_tasks = DemoTasks
