"""Writes committed test cases into the output directory on the master.

The directory is often an AFL sync directory (``afl_out/<name>/queue``) that AFL reads while we
write, so every file appears atomically under its final name, and AFL-style ids only grow
(AFL's sync remembers the highest id it imported from each foreign queue).
"""

from __future__ import annotations

import bisect
import hashlib
import io
import os
import pathlib
import re
import secrets
import stat
import sys
from array import array
from collections.abc import Callable, Iterator

from store.lock import held_file_ids

from .errors import UsageError

__all__ = ["TestcaseWriter", "input_id", "sanitize_src"]

_AFL_ID = re.compile(r"^id:(\d+)")
_AFL_ID_B = re.compile(rb"^id:(\d+)")
_UNSAFE_SRC = re.compile(r"[^A-Za-z0-9._-]")
_SRC_MAX = 40
_KEY_BYTES = 16  # of a SHA-256: no two contents of a campaign share them
# Our temp files are dot files: AFL and our own scan skip them.
_TMP_PREFIX = ".tcw-tmp-"
_TMP_PREFIX_B = _TMP_PREFIX.encode()
# The digest and inode of each AFL-style file, so that a start reads only the files it does
# not know. Kept beside the queue, in the instance directory (DIR/NAME/): `afl-fuzz -i` and
# `find -type f` tools (afl-cmin) read dot files in a queue too; AFL's sync reads only other
# instances' queue/. A cache of the directory: lost or damaged, it costs one reading of the
# files again, never a wrong answer (a hit is compared byte for byte).
INDEX_NAME = ".coordinator-index"
_INDEX_HEADER = b"coordinator test-case index 2\n"
# "<first 16 bytes of the SHA-256, hex> <inode> <name>\n"
_RECORD = re.compile(rb"^([0-9a-f]{32}) ([0-9]+) ([^\n]+)\n\Z")
_HEX = b"0123456789abcdef"
_OFFSET_BITS = 40  # an index of up to 1 TB: a record's offset beside its key in one int
#: Unknown files past this many at a start: one line says they are read, and why.
SAY_HASHING = 10_000
#: Records appended at least this often while a start reads unknown files (a master killed
#: during a long first reading keeps what it read).
FLUSH_EVERY = 10_000


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
    nothing is held in memory for them. AFL-style names do not: the digest and inode of each
    file are kept in ``out_dir.parent/.coordinator-index`` (`INDEX_NAME`, beside the queue
    ``DIR/NAME/queue``, in the instance directory), so a content written before a master
    restart is not written again, and a start (`scan`) lists the directory but reads only the
    files the index does not name with their inode (a crash between a file and its record, a
    file put there or replaced by hand; one overwritten in place keeps its inode and is not
    noticed). In memory: 16 bytes per file of earlier starts (an 8-byte key and where
    its record is), the digest and name of those written since. Single-threaded use (the
    master loop) is assumed.
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
        # AFL style, the files written or read by this process: the first 16 bytes of a
        # content's SHA-256 -> the name of its file. Those of earlier starts are in the index
        # file; only `_keys` (sorted first 8 bytes of their digests) and `_offsets` (where each
        # one's record is) are held: a dict held ~150 bytes a file, 44 MiB for 300,000.
        self._names: dict[bytes, str] = {}
        self._keys = array("Q")
        self._offsets = array("Q")
        #: Where the index is (the only place it is derived): beside the queue, not in it.
        self.index_path = self.out_dir.parent / INDEX_NAME
        self._index: io.FileIO | None = None  # (closed with the writer)
        self._index_writable = False  # opened read-only: lookups work, no record is added
        self._index_pending: list[bytes] = []
        #: What the last `scan` did: files listed, read (not in the index), index rewritten?
        self.scanned: tuple[int, int, bool] = (0, 0, False)
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
        if not self.afl_style:
            # Its names say where a content is: the listing only finds the temp files.
            with os.scandir(self.out_dir) as it:
                for entry in it:
                    if entry.name.startswith(_TMP_PREFIX):
                        _remove_quietly(entry.path)  # left by a master killed mid-write
            return
        # Where the index was first kept (queue/, never released): AFL's -i reads it there.
        # Its records had no inode: the files are read once more instead.
        _remove_quietly(os.path.join(self.out_dir, INDEX_NAME))
        index = self.index_path
        packed, known, damaged = _read_index(index)
        listed, matched = 0, 0
        unknown: list[bytes] = []
        inodes = array("Q")  # of the names in `unknown`
        next_id = self._next_id
        # Streamed, and in bytes: a list of the entries held ~1 KB a file at once (290 MiB
        # for 300,000), and names the index matches as it stores them, undecoded. A name is
        # known with its inode (d_ino: no stat), so a file replaced under it is read again.
        for name, inode in _listing(self.out_dir, remove_temp=True):
            listed += 1
            match = _AFL_ID_B.match(name)
            if match and int(match.group(1)) >= next_id:
                next_id = int(match.group(1)) + 1
            if hash((name, inode)) in known:
                matched += 1
            else:
                unknown.append(name)
                inodes.append(inode)
        self._next_id = next_id
        # Records of files no longer there (the directory emptied, a file replaced), two of
        # one name, a damaged or torn line: the index is written again from what is listed.
        rewrite = damaged or matched != len(known) or len(packed) != len(known)
        del known
        if rewrite:
            packed = _rewrite_index(index, _listed(self.out_dir))
        self._open_index()
        if packed is None or self._index is None:
            # The index could not be written again (it is removed) or opened: the names it
            # matched are known nowhere, so they are read now, or their contents would be
            # written again.
            packed = []
            if matched:
                unknown, inodes = [], array("Q")
                for name, inode in _listing(self.out_dir):
                    unknown.append(name)
                    inodes.append(inode)
        self._load_keys(packed)
        self._read_unknown(unknown, inodes)
        self.scanned = (listed, len(unknown), rewrite)
        flushed = self._flush_index()
        if unknown and flushed and self._index_writable:
            # What was just read is in the index now: held as compactly as the rest.
            reread = _read_index(index)
            if not reread[2]:
                self._load_keys(reread[0])
                self._names.clear()

    def _load_keys(self, packed: list[int]) -> None:
        packed.sort()
        mask = (1 << _OFFSET_BITS) - 1
        self._keys = array("Q", (p >> _OFFSET_BITS for p in packed))
        self._offsets = array("Q", (p & mask for p in packed))
        packed.clear()

    def _read_unknown(self, names: list[bytes], inodes: array) -> None:
        """Reads the files the index does not name, and records them there."""
        if not names:
            return
        if len(names) >= SAY_HASHING:
            print(f"coordinator: reading {len(names):,} test cases in {self.out_dir} that its "
                  f"index ({self.index_path}) does not name yet, to know their contents; a "
                  f"later start reads only files added since", file=sys.stderr, flush=True)
        campaign = held_file_ids()
        for raw, inode in zip(names, inodes, strict=True):
            name = os.fsdecode(raw)
            path = os.path.join(self.out_dir, name)
            try:
                st = os.stat(path, follow_symlinks=False)
            except OSError:
                continue  # vanished since the listing: nothing to read
            if (st.st_dev, st.st_ino) in campaign:
                # The campaign's database (or its -wal, -shm) kept in the queue: reading it
                # would drop SQLite's POSIX locks on it (store.lock.held_campaign_file).
                print(f"coordinator: {path} is a file of the campaign's database; "
                      f"not read as a test case (keep the database out of the AFL queue)",
                      file=sys.stderr, flush=True)
                continue
            digest = _hash_file(path)
            if digest is not None:
                # (A second file of a content known: recorded too, or read at each start.)
                self._remember(digest[:_KEY_BYTES], name, inode,
                               first=self._known(digest[:_KEY_BYTES]) is None)
                if len(self._index_pending) >= FLUSH_EVERY:
                    self._flush_index()

    def _known(self, key: bytes) -> str | None:
        """The name of the file the index or this process has for the digest `key`."""
        name = self._names.get(key)
        if name is not None or self._index is None:
            return name
        short = int.from_bytes(key[:8], "big")
        i = bisect.bisect_left(self._keys, short)
        while i < len(self._keys) and self._keys[i] == short:
            try:
                record = _record_at(self._index.fileno(), self._offsets[i])
            except OSError:
                record = None
            if record is not None and record[0] == key:
                return record[1]
            i += 1
        return None

    def _remember(self, key: bytes, name: str, inode: int, *, first: bool = True) -> None:
        if first:
            self._names[key] = name
        raw = os.fsencode(name)
        if b"\n" not in raw:  # (such a name is read again at each start)
            self._index_pending.append(b"%s %d %s\n" % (key.hex().encode(), inode, raw))

    def _flush_index(self) -> bool:
        """Appends the records of the files written or read since the last call; whether all
        are in the index now. Not synced: a record lost with the OS only makes the next start
        read that file again. Never fails the writer (a full disk, an index it may not write):
        what is not recorded is known here (`_names`) and read again at the next start."""
        if not self._index_pending:
            return True
        self._open_index()
        if self._index is None or not self._index_writable:
            # Those files are not in the index: the next start reads them. (Not kept pending:
            # they would pile up for the writer's life.)
            self._index_pending.clear()
            return False
        data = b"".join(self._index_pending)
        done = _append(self._index, data)
        # What was not written is kept, whole or the rest of a record the write cut short:
        # appended next time, it completes the line.
        self._index_pending = [data[done:]] if done < len(data) else []
        return done == len(data)

    def _open_index(self) -> None:
        if self._index is not None or not self.out_dir.is_dir():
            return
        path = self.index_path
        try:
            # Held open while the writer lives: a hit reads its record with one pread.
            f = open(path, "a+b", buffering=0)  # noqa: SIM115
        except OSError:
            try:
                # One it may read but not append to (another user's): lookups still work.
                self._index = open(path, "rb", buffering=0)  # noqa: SIM115
            except OSError:
                return
            self._index_writable = False
            return
        try:
            if f.seek(0, os.SEEK_END) == 0 and _append(f, _INDEX_HEADER) != len(_INDEX_HEADER):
                raise OSError("the index's header could not be written")
        except OSError:
            f.close()
            _remove_quietly(str(path))  # (an empty or torn header: nothing lost)
            return
        self._index = f
        self._index_writable = True

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
        self._flush_index()
        if self._unsynced:
            self._unsynced = False
            _fsync_dir(self.out_dir)

    def _store(self, content: bytes, src: str,
               taken: Callable[[pathlib.Path], bool] | None) -> tuple[pathlib.Path, bool]:
        content = bytes(content)
        digest = hashlib.sha256(content).digest()
        if not self.afl_style:
            return self._store_plain(content, digest.hex())
        known = self._known(digest[:_KEY_BYTES])
        # Compared, not trusted: the file may have been removed or replaced since its record.
        if known is not None and _holds(self.out_dir / known, content):
            return self.out_dir / known, False
        target = self._free_afl_name(src, taken)
        inode = self._write_atomically(target, content)
        self._remember(digest[:_KEY_BYTES], target.name, inode)
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

    def _write_atomically(self, target: pathlib.Path, content: bytes) -> int:
        """Returns the file's inode (what the index records with its name)."""
        self.out_dir.mkdir(parents=True, exist_ok=True)  # created on the first write
        fd, tmp = _create_temp(self.out_dir)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(content)
                f.flush()
                os.fsync(f.fileno())
                inode = os.fstat(f.fileno()).st_ino
            os.replace(tmp, target)
        except BaseException:
            _remove_quietly(tmp)
            raise
        # (The directory's fsync, in `sync`: 5.8 ms a file with one each, 1.1 with one for
        # 500 files, on this VM's ext4; a SymCC run writes hundreds.)
        self._unsynced = True
        return inode


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


def _read_index(path: pathlib.Path) -> tuple[list[int], set[int], bool]:
    """The index's records: each one's key (the digest's first 8 bytes) and offset packed in
    one int, the `hash` of each (name as bytes, inode), and whether anything in it was not a
    record. (Checked by shape, not by `_RECORD`, whose match was ~0.6 s of 300,000 lines; the
    digest strictly: `int(..., 16)` takes "-", " " and "_" too, and a negative key would stop
    the start.)"""
    packed: list[int] = []
    names: set[int] = set()
    damaged = False
    try:
        with open(path, "rb") as f:
            if f.readline() != _INDEX_HEADER:
                return [], set(), True
            offset = len(_INDEX_HEADER)
            for line in f:
                end = len(line) - 1
                space = line.find(b" ", 33, end)
                if (end < 36 or line[32] != 32 or line[end] != 10 or space < 34
                        or space == end - 1 or line[:32].translate(None, _HEX)
                        or not line[33:space].isdigit()):
                    damaged = True
                else:
                    packed.append(int(line[:16], 16) << _OFFSET_BITS | offset)
                    names.add(hash((line[space + 1:end], int(line[33:space]))))
                offset += len(line)
    except FileNotFoundError:
        return [], set(), False
    except OSError:
        return [], set(), True
    return packed, names, damaged


def _records(path: pathlib.Path) -> Iterator[tuple[bytes, int]]:
    """The index's well-formed records, each with the `hash` of its (name, inode)."""
    try:
        with open(path, "rb") as f:
            if f.readline() == _INDEX_HEADER:
                for line in f:
                    match = _RECORD.match(line)
                    if match:
                        yield line, hash((match.group(3), int(match.group(2))))
    except OSError:
        return


def _rewrite_index(path: pathlib.Path, listed: set[int]) -> list[int] | None:
    """Writes the index again with one record for each (name, inode) in `listed` (the last
    one the old index had) and returns its packed keys (`_read_index`). On failure (a full
    disk) the index is removed and None returned: nothing in it can be trusted to be there."""
    last: dict[int, int] = {}
    for n, (_line, ident) in enumerate(_records(path)):
        if ident in listed:
            last[ident] = n
    keep = set(last.values())
    del last
    packed: list[int] = []
    tmp = path.with_name(_TMP_PREFIX + "index")
    try:
        with open(tmp, "wb") as out:
            out.write(_INDEX_HEADER)
            offset = len(_INDEX_HEADER)
            for n, (line, _ident) in enumerate(_records(path)):
                if n in keep:
                    out.write(line)
                    packed.append(int(line[:16], 16) << _OFFSET_BITS | offset)
                    offset += len(line)
        os.replace(tmp, path)
    except OSError:
        _remove_quietly(str(tmp))
        _remove_quietly(str(path))
        return None
    return packed


def _listing(directory: pathlib.Path, *, remove_temp: bool = False) -> Iterator[tuple[bytes, int]]:
    """(name as bytes, inode) of each regular file in `directory` but dot names, streamed
    (names and d_type/d_ino from the listing: no stat). `remove_temp`: the temp files a
    master killed mid-write left are removed."""
    with os.scandir(os.fsencode(directory)) as it:
        for entry in it:
            name = entry.name
            if name[:1] == b".":
                if remove_temp and name.startswith(_TMP_PREFIX_B):
                    _remove_quietly(entry.path)  # left by a master killed mid-write
                continue
            if entry.is_file(follow_symlinks=False):
                yield name, entry.inode()


def _listed(directory: pathlib.Path) -> set[int]:
    """The `hash` of each (name as bytes, inode) of `_listing`."""
    return {hash(item) for item in _listing(directory)}


def _append(f: io.FileIO, data: bytes) -> int:
    """Writes `data` at the end of `f`; how many bytes were written (a raw write may write
    fewer than it was given, and a full disk fails the next one)."""
    done = 0
    view = memoryview(data)
    try:
        while done < len(data):
            n = f.write(view[done:])
            if not n:
                break
            done += n
    except OSError:
        pass
    return done


def _record_at(fd: int, offset: int) -> tuple[bytes, str] | None:
    line = os.pread(fd, 4096, offset).split(b"\n", 1)[0] + b"\n"
    match = _RECORD.match(line)
    if match is None:
        return None
    return bytes.fromhex(match.group(1).decode()), os.fsdecode(match.group(3))


def _holds(path: pathlib.Path, content: bytes) -> bool:
    """Whether `path` is a regular file with exactly `content`."""
    try:
        st = path.stat()
        return (stat.S_ISREG(st.st_mode) and st.st_size == len(content)
                and path.read_bytes() == content)
    except OSError:
        return False


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
