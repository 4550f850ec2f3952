"""TestcaseWriter against a real directory."""

from __future__ import annotations

import errno
import hashlib
import io
import os
import pathlib
import sys

import pytest

from coordinator.errors import UsageError
from coordinator.output import (
    INDEX_NAME,
    TestcaseWriter,
    afl_sync_counter,
    input_id,
    sanitize_src,
)


@pytest.fixture
def tmp_path(tmp_path):
    """Each test's own directory, one level down: an AFL-style writer keeps its index beside
    its queue (`out_dir.parent`), which must not be a directory that all tests share."""
    queue = tmp_path / "queue"
    queue.mkdir()
    return queue


def listing(directory: pathlib.Path) -> list[str]:
    """The files in `directory` (temp files and dot files included)."""
    return sorted(p.name for p in directory.iterdir())


def test_afl_style_names_and_content(tmp_path):
    out = tmp_path / "deep" / "queue"  # parents are created
    writer = TestcaseWriter(out, afl_style=True)
    first = writer.write(b"alpha", "worker3")
    second = writer.write(b"beta", "worker4")
    assert first == out / "id:000000,src:worker3"
    assert second == out / "id:000001,src:worker4"
    assert first.read_bytes() == b"alpha"
    assert listing(out) == ["id:000000,src:worker3", "id:000001,src:worker4"]  # no temp files


def test_plain_names_are_the_content_hash(tmp_path):
    writer = TestcaseWriter(tmp_path, afl_style=False)
    path = writer.write(b"gamma", "ignored")
    assert path == tmp_path / hashlib.sha256(b"gamma").hexdigest()[:16]
    assert path.read_bytes() == b"gamma"


def test_plain_names_find_a_duplicate_by_name_across_restarts(tmp_path):
    """Plain names say where a content is: no digest of any file is held or read at start
    (they cost 524 bytes each, and seconds of hashing at every restart)."""
    first = TestcaseWriter(tmp_path, afl_style=False)
    path = first.write(b"delta", "a")
    again = TestcaseWriter(tmp_path, afl_style=False)
    assert again.store(b"delta", "b") == (path, False)
    assert listing(tmp_path) == [path.name]


@pytest.mark.timeout(30)
def test_plain_name_taken_by_other_content_is_never_clobbered(tmp_path):
    digest = hashlib.sha256(b"epsilon").hexdigest()
    (tmp_path / digest[:16]).write_bytes(b"not epsilon")
    writer = TestcaseWriter(tmp_path, afl_style=False)
    assert writer.store(b"epsilon", "a") == (tmp_path / digest, True)
    assert writer.store(b"epsilon", "a") == (tmp_path / digest, False)
    assert (tmp_path / digest[:16]).read_bytes() == b"not epsilon"
    (tmp_path / digest).write_bytes(b"neither")
    with pytest.raises(FileExistsError, match="other content than their names say"):
        writer.store(b"epsilon", "a")
    # Something at a name that is not a regular file is not the content either (reading a
    # FIFO there would block the master; a directory raised and stopped the run).
    zeta = hashlib.sha256(b"zeta").hexdigest()
    (tmp_path / zeta[:16]).mkdir()
    assert writer.store(b"zeta", "a") == (tmp_path / zeta, True)
    empty = hashlib.sha256(b"").hexdigest()
    os.mkfifo(tmp_path / empty[:16])
    assert writer.store(b"", "a") == (tmp_path / empty, True)


def test_duplicate_content_is_written_once(tmp_path):
    writer = TestcaseWriter(tmp_path, afl_style=True)
    assert writer.write(b"same", "a") is not None
    assert writer.write(b"same", "b") is None
    assert len(listing(tmp_path)) == 1


def test_dedupe_and_ids_survive_a_new_writer(tmp_path):
    first = TestcaseWriter(tmp_path, afl_style=True)
    first.write(b"one", "x")
    first.write(b"two", "x")
    again = TestcaseWriter(tmp_path, afl_style=True)
    assert again.write(b"one", "y") is None
    assert again.write(b"three", "y") == tmp_path / "id:000002,src:y"


def test_ids_continue_after_the_highest_existing_id(tmp_path):
    (tmp_path / "id:000041,src:afl").write_bytes(b"from before")
    (tmp_path / "id:000007,orig:seed").write_bytes(b"older")
    (tmp_path / ".hidden").write_bytes(b"not counted")
    writer = TestcaseWriter(tmp_path, afl_style=True)
    assert writer.write(b"from before", "z") is None  # existing content is known
    assert writer.write(b"new", "z") == tmp_path / "id:000042,src:z"


def test_a_name_said_to_be_taken_is_not_given_again(tmp_path):
    """The directory emptied (its files moved away), so ids start over: a name the campaign
    already has as a task's path must not be given to new content."""
    writer = TestcaseWriter(tmp_path, afl_style=True)
    had = {tmp_path / "id:000000,src:a", tmp_path / "id:000001,src:a"}
    assert writer.store(b"new", "a", taken=had.__contains__) == (
        tmp_path / "id:000002,src:a", True)


def test_hostile_src_never_escapes_or_breaks_the_name(tmp_path):
    out = tmp_path / "out"
    writer = TestcaseWriter(out, afl_style=True)
    hostile = "../../etc/passwd,orig:x\n\x00" + "A" * 100
    path = writer.write(b"payload", hostile)
    assert path.parent == out
    assert path.name.startswith("id:000000,src:")
    src = path.name[len("id:000000,src:") :]
    assert len(src) <= 40
    assert set(src) <= set("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789._-")
    assert listing(tmp_path) == [INDEX_NAME, "out"]  # (the index beside the queue)
    assert sanitize_src("") == "unknown"
    assert sanitize_src("rank-3_w.1") == "rank-3_w.1"


def test_stale_temp_files_are_removed_and_ignored(tmp_path):
    (tmp_path / ".tcw-tmp-deadbeef").write_bytes(b"half written")
    writer = TestcaseWriter(tmp_path, afl_style=True)
    assert listing(tmp_path) == []
    assert writer.write(b"half written", "s") == tmp_path / "id:000000,src:s"


def test_an_output_path_that_is_a_file_is_refused_at_once(tmp_path):
    out = tmp_path / "afile"
    out.write_text("x")
    with pytest.raises(UsageError, match="is not a directory"):
        TestcaseWriter(out, afl_style=False)


def _synced(afl_out: pathlib.Path, instance: str, name: str, value: int | bytes) -> None:
    (afl_out / instance / ".synced").mkdir(parents=True, exist_ok=True)
    raw = value if isinstance(value, bytes) else value.to_bytes(4, sys.byteorder)
    (afl_out / instance / ".synced" / name).write_bytes(raw)


def test_ids_start_where_afls_sync_goes_on_after_our_directory_was_emptied(tmp_path):
    """AFL++'s sync_fuzzers looks for exactly `id:<its counter>` in our queue and imports
    nothing until that file exists."""
    _synced(tmp_path, "main", "symcc", 455)
    _synced(tmp_path, "sec", "symcc", 12)
    _synced(tmp_path, "main", "other", 9000)  # another directory's counter: not ours
    _synced(tmp_path, "broken", "symcc", b"\x01")  # short: ignored
    assert afl_sync_counter(tmp_path, "symcc") == ("main", 455)
    queue = tmp_path / "symcc" / "queue"
    writer = TestcaseWriter(queue, afl_style=True, afl_sync=(tmp_path, "symcc"))
    assert writer.resumed_from_sync == ("main", 455)
    assert writer.write(b"new", "000001") == queue / "id:000455,src:000001"
    # our own files beyond the counter win, and then nothing is reported
    again = TestcaseWriter(queue, afl_style=True, afl_sync=(tmp_path, "symcc"))
    assert again.resumed_from_sync is None
    assert again.write(b"newer", "000002") == queue / "id:000456,src:000002"
    assert afl_sync_counter(tmp_path / "missing", "symcc") is None


def test_src_is_the_afl_id_of_the_input_else_the_task():
    assert input_id({"path": "/o/main/queue/id:000123,src:000001,op:havoc"}, 7) == "000123"
    assert input_id({"path": "/o/symcc/queue/id:000042,src:000123"}, 8) == "000042"
    assert input_id({"path": "/seeds/a"}, 9) == "task9"
    assert input_id({"data": 1}, 10) == "task10"


def test_an_output_directory_that_cannot_be_created_is_refused_at_once(tmp_path):
    """Found out at the first test case before, after the campaign was created (exit 3
    instead of a refusal that changes nothing)."""
    (tmp_path / "afile").write_text("x")
    with pytest.raises(UsageError, match="cannot be written"):
        TestcaseWriter(tmp_path / "afile" / "out", afl_style=False, scan=False)
    if os.geteuid() != 0:  # root may write anywhere
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        with pytest.raises(UsageError, match="cannot be written"):
            TestcaseWriter(locked / "out", afl_style=False, scan=False)
    TestcaseWriter(tmp_path / "new" / "deeper", afl_style=False, scan=False)  # created later


def test_the_names_of_a_results_test_cases_are_made_durable_once_not_once_each(tmp_path,
                                                                               monkeypatch):
    """A directory fsync per file held the master ~6 ms a test case on this VM's ext4 (a
    review: 1,000 files a second at best, its progress lines stopped for 8 s); SymCC writes
    hundreds per run. The master writes a result's files with `sync=False`, then one `sync()`
    before the commit that records them."""
    import coordinator.output as output
    synced = []
    monkeypatch.setattr(output, "_fsync_dir", lambda path: synced.append(path))
    w = TestcaseWriter(tmp_path / "q", afl_style=True)
    for i in range(50):
        w.store(b"case %d" % i, src="000001", sync=False)
    assert synced == []
    w.sync()
    w.sync()  # (nothing new since: nothing to do)
    assert synced == [tmp_path / "q"]
    w.store(b"one more", src="000001")  # (the default: durable before it returns)
    assert synced == [tmp_path / "q"] * 2 and len(listing(tmp_path / "q")) == 51


def test_the_master_makes_each_results_test_cases_durable_before_its_commit(tmp_path,
                                                                           monkeypatch):
    """With the files written `sync=False`, the master itself must sync them: at each
    directory fsync, the result whose files it covers is not committed yet, and every one of
    the 60 results that wrote a test case got one."""
    import sqlite3

    from campaigns import finding_campaign

    import coordinator.output as output
    db = tmp_path / "c.db"
    committed_at_sync = []

    def fsync_dir(path):
        with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as c:
            committed_at_sync.append(c.execute(
                "SELECT count(*) FROM results WHERE testcases > 0").fetchone()[0])

    monkeypatch.setattr(output, "_fsync_dir", fsync_dir)
    assert finding_campaign(db).committed == 300
    assert len(committed_at_sync) == 60 and all(
        n < k for k, n in enumerate(committed_at_sync, start=1)), committed_at_sync


def _count_reads(monkeypatch) -> list[str]:
    """The files the writer reads to learn their contents (its own `_hash_file`)."""
    import coordinator.output as output
    read: list[str] = []
    real = output._hash_file

    def counting(path):
        read.append(os.fsdecode(os.path.basename(path)))
        return real(path)

    monkeypatch.setattr(output, "_hash_file", counting)
    return read


@pytest.mark.timeout(120)
def test_a_start_reads_only_the_files_its_index_does_not_name(tmp_path, monkeypatch):
    """A review: each start hashed every file of the queue (300,000 files: 14 s, 361 MiB of
    master before the first WORK), and a SymCC campaign adds files there for days."""
    queue = tmp_path / "queue"
    queue.mkdir()
    for i in range(20_000):  # (as an earlier version left them: no index)
        (queue / f"id:{i:06d},src:000001").write_bytes(b"case %d" % i)
    read = _count_reads(monkeypatch)
    first = TestcaseWriter(queue, afl_style=True)
    assert len(read) == 20_000 and first.scanned == (20_000, 20_000, False)
    read.clear()
    again = TestcaseWriter(queue, afl_style=True)
    assert read == [] and again.scanned == (20_000, 0, False)
    assert len(again._names) == 0 and len(again._keys) == 20_000  # 16 bytes a file
    assert again.store(b"case 12345", src="x") == (queue / "id:012345,src:000001", False)
    # Files the index does not name (put there by hand, or by a master killed between a
    # file and its record) are read, once.
    (queue / "id:020000,src:hand").write_bytes(b"by hand")
    (queue / "seed").write_bytes(b"case 7")  # a content the index has under another name
    third = TestcaseWriter(queue, afl_style=True)
    assert sorted(read) == ["id:020000,src:hand", "seed"] and third.scanned[1] == 2
    assert third.write(b"by hand", "y") is None
    assert third.write(b"new", "y") == queue / "id:020001,src:y"
    read.clear()
    fourth = TestcaseWriter(queue, afl_style=True)
    assert read == [] and fourth.scanned == (20_003, 0, False)
    assert fourth.write(b"new", "z") is None and fourth.write(b"case 7", "z") is None
    assert fourth.write(b"newer", "z") == queue / "id:020002,src:z"


def test_the_first_start_over_a_full_queue_says_it_reads_it(tmp_path, monkeypatch, capsys):
    import coordinator.output as output
    monkeypatch.setattr(output, "SAY_HASHING", 3)
    for i in range(3):
        (tmp_path / f"id:{i:06d},src:afl").write_bytes(b"%d" % i)
    writer = TestcaseWriter(tmp_path, afl_style=True)
    assert "reading 3 test cases" in capsys.readouterr().err
    assert writer.write(b"1", "s") is None and len(writer._names) == 0  # (compact already)
    TestcaseWriter(tmp_path, afl_style=True)
    assert capsys.readouterr().err == ""


def test_an_emptied_directory_is_not_taken_for_its_index(tmp_path, monkeypatch):
    """The files gone (moved away), the index left: their contents are written again, ids
    start over as before, and the index is written again without them."""
    first = TestcaseWriter(tmp_path, afl_style=True)
    first.write(b"one", "a")
    first.write(b"two", "a")
    for name in listing(tmp_path):
        (tmp_path / name).unlink()
    again = TestcaseWriter(tmp_path, afl_style=True)
    assert again.scanned == (0, 0, True) and len(again._keys) == 0
    assert again.write(b"two", "b") == tmp_path / "id:000000,src:b"
    read = _count_reads(monkeypatch)
    third = TestcaseWriter(tmp_path, afl_style=True)
    assert read == [] and third.write(b"two", "c") is None
    assert third.write(b"one", "c") == tmp_path / "id:000001,src:c"


def test_a_file_replaced_under_a_known_name_is_not_taken_for_its_old_content(tmp_path):
    first = TestcaseWriter(tmp_path, afl_style=True)
    path = first.write(b"old", "a")
    path.write_bytes(b"other")  # by hand, behind the index's back
    again = TestcaseWriter(tmp_path, afl_style=True)
    assert again.store(b"old", "b") == (tmp_path / "id:000001,src:b", True)


def test_a_damaged_or_lost_index_costs_a_reading_never_a_wrong_answer(tmp_path, monkeypatch):
    first = TestcaseWriter(tmp_path, afl_style=True)
    for i in range(5):
        first.write(b"c%d" % i, "a")
    index = tmp_path.parent / INDEX_NAME
    with open(index, "ab") as f:
        f.write(b"0123abc torn rec")  # the OS crashed in an append
    read = _count_reads(monkeypatch)
    again = TestcaseWriter(tmp_path, afl_style=True)
    assert read == [] and again.scanned == (5, 0, True)
    assert again.write(b"c3", "b") is None
    index.write_bytes(b"something else entirely\n")
    third = TestcaseWriter(tmp_path, afl_style=True)
    assert len(read) == 5 and third.scanned == (5, 5, True)
    assert third.write(b"c4", "b") is None and third.write(b"c9", "b").name.startswith(
        "id:000005,")
    index.unlink()
    read.clear()
    fourth = TestcaseWriter(tmp_path, afl_style=True)
    assert len(read) == 6 and fourth.write(b"c0", "b") is None


def test_plain_names_keep_no_index_and_find_duplicates_by_name(tmp_path):
    """`--out` names are digests: a start keeps no index, anywhere, and reads nothing."""
    writer = TestcaseWriter(tmp_path, afl_style=False)
    for i in range(10):
        writer.write(b"p%d" % i, "a")
    (tmp_path / ".tcw-tmp-0011223344556677").write_bytes(b"half")
    again = TestcaseWriter(tmp_path, afl_style=False)
    assert again.write(b"p3", "b") is None and again.write(b"p10", "b") is not None
    assert len(listing(tmp_path)) == 11  # (the temp file removed)
    assert not (tmp_path / INDEX_NAME).exists() and not (tmp_path.parent / INDEX_NAME).exists()


def _fail_open(monkeypatch, path: pathlib.Path, modes: str, failure) -> None:
    """`open` in coordinator.output, for `path` in a mode with one of `modes`: raises
    `failure` (an exception), or returns what it makes (a callable of the mode)."""
    import builtins

    import coordinator.output as output

    def fake(file, mode="r", *args, **kwargs):
        if os.fspath(file) == os.fspath(path) and any(m in mode for m in modes):
            if isinstance(failure, BaseException):
                raise failure
            return failure(mode)
        return builtins.open(file, mode, *args, **kwargs)

    monkeypatch.setattr(output, "open", fake, raising=False)


def test_the_index_is_kept_beside_the_queue_and_an_old_one_in_it_removed(tmp_path):
    """`afl-fuzz -i` and `find -type f` tools (afl-cmin) read dot files in a queue too."""
    (tmp_path / INDEX_NAME).write_bytes(b"coordinator test-case index 1\n")  # (its first place)
    writer = TestcaseWriter(tmp_path, afl_style=True)
    writer.write(b"one", "a")
    assert listing(tmp_path) == ["id:000000,src:a"]
    assert writer.index_path == tmp_path.parent / INDEX_NAME and writer.index_path.is_file()


def test_an_index_it_may_only_read_still_finds_earlier_contents(tmp_path, monkeypatch):
    """Another user's index (mode 0644): it cannot be appended to, but its lookups work; the
    files written meanwhile are read at the next start."""
    first = TestcaseWriter(tmp_path, afl_style=True)
    for i in range(3):
        first.write(b"c%d" % i, "a")
    _fail_open(monkeypatch, tmp_path.parent / INDEX_NAME, "a+w",
               PermissionError(errno.EACCES, "Permission denied"))
    read = _count_reads(monkeypatch)
    again = TestcaseWriter(tmp_path, afl_style=True)
    assert read == [] and again.write(b"c1", "b") is None
    assert again.write(b"new", "b") == tmp_path / "id:000003,src:b"
    third = TestcaseWriter(tmp_path, afl_style=True)
    assert read == ["id:000003,src:b"] and third.scanned == (4, 1, False)
    assert third.write(b"c2", "c") is None and third.write(b"new", "c") is None


def test_a_file_renamed_over_a_known_name_is_read_again(tmp_path, monkeypatch):
    """Its inode is not the one its record has: its new content is known, not written twice."""
    first = TestcaseWriter(tmp_path, afl_style=True)
    path = first.write(b"old", "a")
    (tmp_path.parent / "new").write_bytes(b"new content")
    os.replace(tmp_path.parent / "new", path)
    read = _count_reads(monkeypatch)
    again = TestcaseWriter(tmp_path, afl_style=True)
    assert read == [path.name] and again.scanned == (1, 1, True)
    assert again.write(b"new content", "b") is None
    assert again.write(b"old", "b") == tmp_path / "id:000001,src:b"
    read.clear()
    third = TestcaseWriter(tmp_path, afl_style=True)
    assert read == [] and third.scanned == (2, 0, False)
    assert third.write(b"new content", "c") is None and third.write(b"old", "c") is None


def test_a_damaged_digest_is_a_damaged_record_not_a_failed_start(tmp_path, monkeypatch):
    """`int(key, 16)` takes "-": a negative key stopped the start (OverflowError)."""
    first = TestcaseWriter(tmp_path, afl_style=True)
    first.write(b"c0", "a")
    first.write(b"c1", "a")
    index = tmp_path.parent / INDEX_NAME
    header, one, two, end = index.read_bytes().split(b"\n")
    index.write_bytes(b"\n".join([header, b"-" + one[1:], two[:32].upper() + two[32:], end]))
    read = _count_reads(monkeypatch)
    again = TestcaseWriter(tmp_path, afl_style=True)
    assert sorted(read) == ["id:000000,src:a", "id:000001,src:a"]
    assert again.scanned == (2, 2, True) and again.write(b"c0", "b") is None
    read.clear()
    assert TestcaseWriter(tmp_path, afl_style=True).scanned == (2, 0, False) and read == []


def test_a_full_disk_never_fails_the_writer_for_its_index(tmp_path, monkeypatch):
    _fail_open(monkeypatch, tmp_path.parent / INDEX_NAME, "a",
               lambda mode: open("/dev/full", mode, buffering=0))  # noqa: SIM115
    writer = TestcaseWriter(tmp_path, afl_style=True)  # (the index's header: ENOSPC)
    assert writer.write(b"one", "a") == tmp_path / "id:000000,src:a"
    assert writer.write(b"one", "b") is None


def test_a_short_write_of_the_index_keeps_what_it_did_not_write(tmp_path, monkeypatch):
    cut = []

    class Short(io.FileIO):
        def write(self, data):
            data = bytes(data)
            if not cut and not data.startswith(b"coordinator"):
                cut.append(data)
                data = data[:len(data) // 2]
            return super().write(data)

    _fail_open(monkeypatch, tmp_path.parent / INDEX_NAME, "a",
               lambda mode: Short(tmp_path.parent / INDEX_NAME, "a+"))
    writer = TestcaseWriter(tmp_path, afl_style=True)
    writer.write(b"c0", "a")
    writer.write(b"c1", "a")
    assert cut
    read = _count_reads(monkeypatch)
    again = TestcaseWriter(tmp_path, afl_style=True)
    assert read == [] and again.scanned == (2, 0, False) and again.write(b"c0", "b") is None


def test_an_index_that_cannot_be_written_again_makes_the_start_read_its_files(tmp_path,
                                                                            monkeypatch):
    """Removed when it could not be written again: the names it matched are read now, or
    their contents would be written a second time."""
    first = TestcaseWriter(tmp_path, afl_style=True)
    for i in range(3):
        first.write(b"c%d" % i, "a")
    with open(tmp_path.parent / INDEX_NAME, "ab") as f:
        f.write(b"torn")
    _fail_open(monkeypatch, tmp_path.parent / ".tcw-tmp-index", "w",
               OSError(errno.ENOSPC, "No space left on device"))
    read = _count_reads(monkeypatch)
    again = TestcaseWriter(tmp_path, afl_style=True)
    assert len(read) == 3 and again.write(b"c1", "b") is None
    read.clear()
    assert TestcaseWriter(tmp_path, afl_style=True).scanned == (3, 0, False) and read == []


def test_a_long_first_reading_keeps_what_it_read_when_killed(tmp_path, monkeypatch):
    import coordinator.output as output
    monkeypatch.setattr(output, "FLUSH_EVERY", 2, raising=False)
    for i in range(5):
        (tmp_path / f"id:{i:06d},src:afl").write_bytes(b"%d" % i)
    real, hashed = output._hash_file, []

    def killed_at_the_fifth(path):
        if len(hashed) == 4:
            raise KeyboardInterrupt  # (the master killed)
        hashed.append(path)
        return real(path)

    monkeypatch.setattr(output, "_hash_file", killed_at_the_fifth)
    with pytest.raises(KeyboardInterrupt):
        TestcaseWriter(tmp_path, afl_style=True)
    monkeypatch.setattr(output, "_hash_file", real)
    read = _count_reads(monkeypatch)
    again = TestcaseWriter(tmp_path, afl_style=True)
    assert len(read) == 1 and again.scanned == (5, 1, False)
