"""Writes committed test cases into the output directory on the master.

The directory is often an AFL sync directory (``afl_out/<name>/queue``) that AFL reads while we
write, so every file appears atomically under its final name, and AFL-style ids only grow
(AFL's sync remembers the highest id it imported from each foreign queue).
"""

from __future__ import annotations

import hashlib
import os
import pathlib
import re
import secrets
import stat
import sys
from collections.abc import Callable

from store.lock import held_file_ids

from .errors import UsageError

__all__ = ["TestcaseWriter", "input_id", "sanitize_src"]

_AFL_ID = re.compile(r"^id:(\d+)")
_UNSAFE_SRC = re.compile(r"[^A-Za-z0-9._-]")
_SRC_MAX = 40
_KEY_BYTES = 16  # of a SHA-256: no two contents of a campaign share them
# Our temp files are dot files: AFL and our own scan skip them.
_TMP_PREFIX = ".tcw-tmp-"


def input_id(payload: dict, task_id: int) -> str:
    """The `src:` of a task's test cases: the AFL id of the input it ran on, as SymCC's own
    helper writes it (`id:000123,...` gives 000123), else `task<id>`."""
    match = _AFL_ID.match(os.path.basename(str(payload.get("path", ""))))
    return match.group(1) if match else f"task{task_id}"


def sanitize_src(src: str) -> str:
    """``src`` reduced to ``[A-Za-z0-9._-]``, at most 40 characters (never empty)."""
    cleaned = _UNSAFE_SRC.sub("_", str(src))[:_SRC_MAX]
    return cleaned or "unknown"


class TestcaseWriter:
    """Atomic, content-deduplicated writer of test cases.

    Names never come from a worker: they are ``id:NNNNNN,src:<src>`` (AFL style) or the first
    16 hex digits of the content's SHA-256. A plain name says where a content would be, so
    nothing is held in memory for them. AFL-style names do not: the digests of the files in
    ``out_dir`` are read when the writer starts (`scan`) and kept, 16 bytes and a name per
    file, so a content written before a master restart is not written again. Single-threaded
    use (the master loop) is assumed.
    """

    __test__ = False  # the name starts with "Test"; keep pytest from collecting it

    def __init__(self, out_dir: pathlib.Path, afl_style: bool, *, scan: bool = True,
                 afl_sync: tuple[pathlib.Path, str] | None = None) -> None:
        """`scan=False` only checks the directory; `scan()` then reads it (and removes the
        temp files a killed master left) once this process holds the campaign and the
        directory (`output_lock`): before that, those temp files may be a live master's writes
        in progress, this campaign's or another's. `afl_sync` is (AFL's -o
        directory, our instance name): ids then also start past what AFL's instances already
        imported from us."""
        self.out_dir = pathlib.Path(out_dir)
        self.afl_style = afl_style
        self.afl_sync = afl_sync
        # AFL style: the first 16 bytes of a content's SHA-256 -> the name of its file. (A dict
        # of hex digest -> Path held 524 bytes per file: 6 GB for a 10-million-file campaign.)
        self._names: dict[bytes, str] = {}
        self._next_id = 0
        self._unsynced = False  # a name written whose directory entry is not durable yet
        #: (AFL instance, its import counter) when that counter, not our files, set the next id
        self.resumed_from_sync: tuple[str, int] | None = None
        if self.out_dir.exists() and not self.out_dir.is_dir():
            raise UsageError(f"{self.out_dir} is not a directory (new test cases are written "
                             f"there)")
        # Found out at the first test case otherwise: after the campaign was created.
        nearest = self.out_dir.absolute()
        while not nearest.exists():
            nearest = nearest.parent
        if not (nearest.is_dir() and os.access(nearest, os.W_OK | os.X_OK)):
            raise UsageError(f"{self.out_dir} cannot be written ({nearest} is not a writable "
                             f"directory; new test cases are written there)")
        if scan:
            self.scan()

    def scan(self) -> None:
        if self.out_dir.exists():  # an AFL queue is made at its first write
            self._scan_files()
        if self.afl_sync is not None:
            # AFL's sync imports from us only from the exact id its counter names onwards: after
            # our directory was emptied (a new campaign, AFL still running), ids from 0 again
            # would never be imported, and nothing would say so.
            synced = afl_sync_counter(*self.afl_sync)
            if synced is not None and synced[1] > self._next_id:
                self._next_id, self.resumed_from_sync = synced[1], synced

    def _scan_files(self) -> None:
        with os.scandir(self.out_dir) as it:
            entries = list(it)
        campaign = held_file_ids()
        for entry in entries:
            if entry.name.startswith(_TMP_PREFIX):
                _remove_quietly(entry.path)  # left by a master killed mid-write
                continue
            if entry.name.startswith(".") or not entry.is_file(follow_symlinks=False):
                continue
            if not self.afl_style:
                continue  # its name says where a content is: nothing to read
            try:
                st = entry.stat(follow_symlinks=False)
            except OSError:
                continue  # vanished since the listing: nothing to read
            if (st.st_dev, st.st_ino) in campaign:
                # The campaign's database (or its -wal, -shm) kept in the queue: reading it
                # would drop SQLite's POSIX locks on it (store.lock.held_campaign_file).
                print(f"coordinator: {entry.path} is a file of the campaign's database; "
                      f"not read as a test case (keep the database out of the AFL queue)",
                      file=sys.stderr, flush=True)
                continue
            match = _AFL_ID.match(entry.name)
            if match:
                self._next_id = max(self._next_id, int(match.group(1)) + 1)
            digest = _hash_file(entry.path)
            if digest is not None:
                self._names.setdefault(digest[:_KEY_BYTES], entry.name)

    def write(self, content: bytes, src: str) -> pathlib.Path | None:
        """Writes ``content`` once; returns its path, or None if the content is already there."""
        path, new = self.store(content, src)
        return path if new else None

    def store(self, content: bytes, src: str,
              taken: Callable[[pathlib.Path], bool] | None = None, *,
              sync: bool = True) -> tuple[pathlib.Path, bool]:
        """Like `write`, but returns (path, written now?): the path of a duplicate is the
        file already holding that content (a master restarted between writing a file and
        committing its result still finds it). A new AFL-style name is one no file has,
        nor `taken` says is taken. `sync=False` leaves the directory's fsync, which makes the
        new name durable, to `sync()`: one for all the files of a result, not one each."""
        try:
            return self._store(content, src, taken)
        finally:
            if sync:
                self.sync()

    def sync(self) -> None:
        """Makes the names written since the last call durable (before the commit that
        records them)."""
        if self._unsynced:
            self._unsynced = False
            _fsync_dir(self.out_dir)

    def _store(self, content: bytes, src: str,
               taken: Callable[[pathlib.Path], bool] | None) -> tuple[pathlib.Path, bool]:
        content = bytes(content)
        digest = hashlib.sha256(content).digest()
        if not self.afl_style:
            return self._store_plain(content, digest.hex())
        known = self._names.get(digest[:_KEY_BYTES])
        if known is not None and (self.out_dir / known).exists():
            return self.out_dir / known, False
        target = self._free_afl_name(src, taken)
        self._write_atomically(target, content)
        self._names[digest[:_KEY_BYTES]] = target.name
        return target, True

    def _store_plain(self, content: bytes, digest: str) -> tuple[pathlib.Path, bool]:
        # Same 64-bit prefix with other content: astronomically rare, but never clobbered.
        for target in (self.out_dir / digest[:16], self.out_dir / digest):
            try:
                st = target.stat()
                # Not a regular file (a directory, a FIFO whose read would block): not it.
                same = (stat.S_ISREG(st.st_mode) and st.st_size == len(content)
                        and target.read_bytes() == content)
            except FileNotFoundError:
                self._write_atomically(target, content)
                return target, True
            except OSError:
                continue  # a file that cannot be read: not this content either
            if same:
                return target, False
        raise FileExistsError(f"{self.out_dir / digest[:16]} and {target} hold other content "
                              f"than their names say, or cannot be read; move them away")

    def _free_afl_name(self, src: str,
                       taken: Callable[[pathlib.Path], bool] | None) -> pathlib.Path:
        safe_src = sanitize_src(src)
        while True:
            target = self.out_dir / f"id:{self._next_id:06d},src:{safe_src}"
            self._next_id += 1
            if not target.exists() and (taken is None or not taken(target)):
                return target

    def _write_atomically(self, target: pathlib.Path, content: bytes) -> None:
        self.out_dir.mkdir(parents=True, exist_ok=True)  # created on the first write
        fd, tmp = _create_temp(self.out_dir)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(content)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, target)
        except BaseException:
            _remove_quietly(tmp)
            raise
        # (The directory's fsync, in `sync`: 5.8 ms a file with one each, 1.1 with one for
        # 500 files, on this VM's ext4; a SymCC run writes hundreds.)
        self._unsynced = True


def replace_text(path: pathlib.Path, text: str) -> None:
    """Replace `path` with `text` whole: readers (a launcher polling a pid file, a user
    tailing the stats) see the old file or the new one, never a half-written one. On failure
    (a full disk) no temporary file is left behind and the old file stays."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    except BaseException:
        _remove_quietly(str(tmp))
        raise


def afl_sync_counter(afl_out: pathlib.Path, name: str) -> tuple[str, int] | None:
    """The highest `.synced/<name>` counter among AFL's instances in `afl_out`, with the
    instance's name: the next id of ours each of them will look for (AFL++ `sync_fuzzers`
    keeps it as a native u32). None if no instance has imported from `name` yet."""
    best: tuple[str, int] | None = None
    try:
        with os.scandir(afl_out) as it:
            instances = [e.name for e in it if e.name != name and not e.name.startswith(".")]
    except OSError:
        return None
    for instance in instances:
        try:
            with open(os.path.join(afl_out, instance, ".synced", name), "rb") as f:
                raw = f.read(4)
        except OSError:
            continue
        if len(raw) == 4:
            value = int.from_bytes(raw, sys.byteorder)
            if best is None or value > best[1]:
                best = (instance, value)
    return best


def _hash_file(path: str) -> bytes | None:
    h = hashlib.sha256()
    try:
        with open(path, "rb") as f:
            while chunk := f.read(1 << 20):
                h.update(chunk)
    except OSError:
        return None  # vanished or unreadable: it cannot make a new write a duplicate
    return h.digest()


def _create_temp(directory: pathlib.Path) -> tuple[int, str]:
    # Not mkstemp: its 0600 mode would hide test cases from an AFL running as another user;
    # O_CREAT with 0666 lets the user's umask decide, as for any file they create.
    while True:
        path = os.path.join(directory, _TMP_PREFIX + secrets.token_hex(8))
        try:
            return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666), path
        except FileExistsError:
            continue


def _remove_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def _fsync_dir(path: pathlib.Path) -> None:
    # Makes the new name durable before the result is committed to the store.
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some filesystems refuse fsync on directories; the file itself is synced
    finally:
        os.close(fd)
