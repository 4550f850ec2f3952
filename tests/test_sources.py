"""Task sources against real directories and files."""

from __future__ import annotations

import json
import os
import pathlib
import time

import pytest
from conftest import leases_granted

from coordinator.errors import UsageError
from coordinator.sources import (
    AflQueueSource,
    NewInput,
    TaskFileError,
    afl_queue_missing,
    demo_tasks,
    load_tasks_jsonl,
)
from store.campaign import Store
from store.tasks import enqueue_tasks

# ------------------------------------------------------------------------------------ AFL queue


def put(queue: pathlib.Path, name: str, content: bytes, age_s: float = 100.0) -> pathlib.Path:
    """A queue file whose mtime is ``age_s`` in the past (settled unless age_s is small)."""
    path = queue / name
    path.write_bytes(content)
    then = time.time() - age_s
    os.utime(path, (then, then))
    return path


@pytest.fixture
def queue(tmp_path: pathlib.Path) -> pathlib.Path:
    path = tmp_path / "afl_out" / "main" / "queue"
    path.mkdir(parents=True)
    return path


def names(found: list[NewInput]) -> list[str]:
    return [pathlib.Path(n.payload["path"]).name for n in found]


def test_afl_returns_new_entries_sorted_and_only_once(tmp_path, queue):
    put(queue, "id:000001,src:000000,op:havoc", b"two")
    put(queue, "id:000000,time:0,orig:seed", b"one")
    source = AflQueueSource(tmp_path / "afl_out", "main", settle_s=0.5)
    found = source.poll()
    assert names(found) == ["id:000000,time:0,orig:seed", "id:000001,src:000000,op:havoc"]
    first = found[0]
    assert first.input_bytes == b"one"
    assert first.payload == {"path": str(queue / "id:000000,time:0,orig:seed")}
    assert pathlib.Path(first.payload["path"]).is_absolute()
    assert first.origin.startswith("afl:main/")
    assert source.poll() == []
    put(queue, "id:000002,src:000001", b"three")
    assert names(source.poll()) == ["id:000002,src:000001"]


def quiet(directory: pathlib.Path, age_s: float = 100.0) -> None:
    then = time.time() - age_s
    os.utime(directory, (then, then))


def test_afl_queue_is_listed_again_only_when_it_changed(tmp_path, queue, monkeypatch):
    """Every poll listed the whole queue: 21-30 ms a second for 40,000 entries, for ever."""
    listings: list[str] = []
    real_scandir = os.scandir

    def counting_scandir(path):
        listings.append(str(path))
        return real_scandir(path)

    monkeypatch.setattr(os, "scandir", counting_scandir)
    put(queue, "id:000000", b"one")
    source = AflQueueSource(tmp_path / "afl_out", "main", settle_s=0.5)
    assert names(source.poll()) == ["id:000000"]
    assert names(source.poll()) == [] and len(listings) == 2  # changed just now: not trusted
    quiet(queue)
    assert source.poll() == [] and len(listings) == 3
    assert source.poll() == [] and source.poll() == [] and len(listings) == 3
    put(queue, "id:000001", b"two")  # a new entry moves the directory's mtime
    assert names(source.poll()) == ["id:000001"] and len(listings) == 4
    # An entry still being written when the listing was trusted is looked at all the same.
    put(queue, "id:000002", b"thr", age_s=0)
    quiet(queue)
    assert source.poll() == [] and len(listings) == 5
    put(queue, "id:000002", b"three")  # written in place: the directory does not change
    assert source.poll() == []  # it changed since the last poll: not settled yet
    assert names(source.poll()) == ["id:000002"] and len(listings) == 5
    # However quiet it looks, the queue is listed again after RELIST_S.
    monkeypatch.setattr(AflQueueSource, "RELIST_S", 0.0)
    source = AflQueueSource(tmp_path / "afl_out", "main", settle_s=0.5)
    assert len(source.poll()) == 3 and source.poll() == [] and len(listings) == 7


def test_afl_entries_of_an_earlier_run_are_not_read_again(tmp_path, queue):
    """After a restart every queue file was read and hashed again before a new one was seen
    (4.4 s for 40,000 entries): the names behind the campaign's tasks are remembered."""
    put(queue, "id:000000", b"old")
    put(queue, "id:000001", b"new")
    db = tmp_path / "c.db"
    store = Store.open(db)
    try:
        first = AflQueueSource(tmp_path / "afl_out", "main")
        with store.transaction("import") as tx:
            enqueue_tasks(tx, [i.as_task() for i in first.poll() if i.input_bytes == b"old"])
        with store.reading() as conn:
            from store.tasks import origins_starting_with
            origins = origins_starting_with(conn, first.origin_prefix)
    finally:
        store.close()
    assert origins == ["afl:main/id:000000"]
    again = AflQueueSource(tmp_path / "afl_out", "main")
    again.remember([*origins, "afl:other/id:000001"])
    assert names(again.poll()) == ["id:000001"]


def test_afl_entry_whose_name_is_not_utf8_is_kept_with_an_escaped_path(tmp_path, queue):
    """Not AFL's naming, but anyone can drop a file in the queue: its name cannot be stored as
    text, and it once failed the whole batch at every start. Its bytes are stored with the
    task (self-contained), so the escaped path is only a label."""
    put(queue, "id:000000,a", b"good")
    bad = os.fsdecode(os.fsencode(str(queue)) + b"/id:000001,\xff\xfe")
    put(queue, os.path.basename(bad), b"odd name")
    found = AflQueueSource(tmp_path / "afl_out", "main").poll()
    assert [f.input_bytes for f in found] == [b"good", b"odd name"]
    escaped = found[1].payload["path"]
    assert escaped == str(queue / "id:000001,\\xff\\xfe") and escaped.encode()
    assert found[1].origin == "afl:main/id:000001,\\xff\\xfe"
    store = Store.open(tmp_path / "c.db")
    try:
        with store.transaction("import") as tx:
            assert len(enqueue_tasks(tx, [f.as_task() for f in found])) == 2
    finally:
        store.close()


def test_afl_ignores_dot_files_directories_and_other_names(tmp_path, queue):
    (queue / ".state").mkdir()
    (queue / ".state" / "id:000009").write_bytes(b"nested")
    (queue / "id:000005,dir").mkdir()
    put(queue, ".id:000003.tmp", b"hidden")
    put(queue, "README.txt", b"not an entry")
    put(queue, "id:000000", b"real")
    found = AflQueueSource(tmp_path / "afl_out", "main").poll()
    assert names(found) == ["id:000000"]


def test_afl_symlink_loop_and_unreadable_queue_do_not_stop_the_run(tmp_path, queue,
                                                                   monkeypatch, capsys):
    """Both used to raise out of the master's round, reported as its output failing (exit 3),
    and again on every --resume."""
    (queue / "id:000001,loop").symlink_to(queue / "id:000001,loop")
    put(queue, "id:000000", b"real")
    source = AflQueueSource(tmp_path / "afl_out", "main")
    assert names(source.poll()) == ["id:000000"]
    real_scandir = os.scandir

    def denied(path):
        raise PermissionError(13, "Permission denied")
    monkeypatch.setattr(os, "scandir", denied)  # root reads anything: simulate AFL's own user
    assert source.poll() == [] and source.poll() == []
    assert capsys.readouterr().err.count("cannot read the AFL queue") == 1  # said once
    monkeypatch.setattr(os, "scandir", real_scandir)
    put(queue, "id:000002", b"later")
    assert names(source.poll()) == ["id:000002"]
    monkeypatch.setattr(os, "scandir", denied)  # a second outage is reported again
    assert source.poll() == []
    assert capsys.readouterr().err.count("cannot read the AFL queue") == 1
    # ... and the start does not also say it waits for the queue to be created
    assert afl_queue_missing(tmp_path / "afl_out", "main") is None
    assert "does not exist yet" in afl_queue_missing(tmp_path / "afl_out", "other")
    (tmp_path / "afl_out" / "other" / "queue").mkdir(parents=True)
    assert afl_queue_missing(tmp_path / "afl_out", "other") is None


def test_an_unreadable_queue_entry_is_said_not_retried_in_silence(tmp_path, queue,
                                                                  monkeypatch, capsys):
    """AFL++ writes its entries 0600: a coordinator running as another user read none of
    them, retried each at every poll, and said nothing. Each is said once (the first few),
    still retried, and taken once it can be read."""
    import coordinator.sources as sources
    for i in range(5):
        put(queue, f"id:00000{i}", f"entry {i}".encode())
    real_read = sources._read_regular

    def denied(path, st, **kw):
        raise PermissionError(13, "Permission denied")
    monkeypatch.setattr(sources, "_read_regular", denied)  # root reads anything
    source = AflQueueSource(tmp_path / "afl_out", "main")
    assert source.poll() == [] and source.poll() == []
    err = capsys.readouterr().err
    assert err.count("cannot be read: Permission denied") == AflQueueSource.SAY_UNREADABLE
    assert "run the coordinator as the fuzzer's user" in err
    assert "further unreadable entries are not said" in err
    monkeypatch.setattr(sources, "_read_regular", real_read)
    assert names(source.poll()) == [f"id:00000{i}" for i in range(5)]


def test_afl_file_still_being_written_waits_until_settled(tmp_path, queue):
    source = AflQueueSource(tmp_path / "afl_out", "main", settle_s=30)
    fresh = put(queue, "id:000000", b"partial", age_s=0)
    assert source.poll() == []
    # it grew, and its mtime now looks old: the size change since the last poll still holds it
    with open(fresh, "ab") as f:
        f.write(b" and the rest")
    then = time.time() - 100
    os.utime(fresh, (then, then))
    assert source.poll() == []
    found = source.poll()
    assert names(found) == ["id:000000"]
    assert found[0].input_bytes == b"partial and the rest"


def test_afl_entry_a_writer_holds_open_is_not_taken_half(tmp_path, queue, capsys):
    """AFL++ writes an entry with open(O_CREAT|O_EXCL), write, close. A writer that paused
    mid-file for longer than the settle time had its first half taken for good (stored,
    hashed and run; the rest never read). Taken only once the writer closed it; one held
    open past a minute is said, once (a stray tool holding it hid it for good, unsaid)."""
    if not leases_granted(tmp_path):
        pytest.skip("no read lease is granted here: the two-poll fallback is tested below")
    source = AflQueueSource(tmp_path / "afl_out", "main", settle_s=0.5)
    path = queue / "id:000000,src:000001,op:havoc"
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
    try:
        os.write(fd, b"first half, ")
        then = time.time() - 100  # as if the writer had paused that long
        os.utime(path, (then, then))
        assert source.poll() == [] and source.poll() == [] and source.poll() == []
        assert capsys.readouterr().err.count("is held open for writing by some process, "
                                             "unchanged for 100 s") == 1
        os.write(fd, b"second half")
    finally:
        os.close(fd)
    os.utime(path, (then, then))
    assert source.poll() == []  # it grew since the previous poll
    found = source.poll()
    assert [f.input_bytes for f in found] == [b"first half, second half"]


def test_afl_entry_opened_for_writing_while_it_is_read_is_read_again(tmp_path, queue,
                                                                    monkeypatch):
    """The lease is held across the read: a writer that opens the entry in between (a trim
    rewriting it in place, as AFL++ does with AFL_NO_UNLINK) waits in its open() and breaks
    the lease, and what was read is not taken; the next poll, after the writer, takes the
    new bytes. (The lease was dropped before the read: the read raced the writer.)"""
    if not leases_granted(tmp_path):
        pytest.skip("no read lease is granted here")
    import fcntl
    import subprocess
    import sys

    from coordinator import sources
    source = AflQueueSource(tmp_path / "afl_out", "main", settle_s=0.5)
    path = put(queue, "id:000000", b"untrimmed bytes")
    then = time.time() - 100
    os.utime(path, (then, then))
    real_lease, writers = sources._read_lease, []

    def lease_then_a_writer(fd):
        got = real_lease(fd)
        if got and not writers:  # the trimmer opens it now, and waits for the lease
            writers.append(subprocess.Popen([sys.executable, "-c", (
                "import os, sys; p = sys.argv[1]; f = open(p, 'r+b'); f.truncate(0); "
                "f.write(b'trimmed'); f.close(); os.utime(p, (1, 1))"), str(path)]))
            deadline = time.monotonic() + 30
            while fcntl.fcntl(fd, fcntl.F_GETLEASE) == fcntl.F_RDLCK:  # (its break pending)
                assert time.monotonic() < deadline, "the writer never broke the lease"
                time.sleep(0.001)
        return got
    monkeypatch.setattr(sources, "_read_lease", lease_then_a_writer)
    assert source.poll() == []
    assert writers[0].wait(timeout=30) == 0
    found = source.poll() or source.poll()
    assert [f.input_bytes for f in found] == [b"trimmed"]


def test_afl_entry_without_a_lease_to_ask_is_taken_once_two_polls_agree(tmp_path, queue,
                                                                        monkeypatch):
    """Where the kernel grants no lease (another user's file without CAP_LEASE, NFS), whether
    a writer holds the file is not known: a poll must find it as the previous one did."""
    import fcntl
    real_fcntl = fcntl.fcntl

    def no_lease(fd, cmd, *arg):
        if cmd == getattr(fcntl, "F_SETLEASE", None):
            raise PermissionError(13, "Permission denied")
        return real_fcntl(fd, cmd, *arg)
    monkeypatch.setattr(fcntl, "fcntl", no_lease)
    source = AflQueueSource(tmp_path / "afl_out", "main", settle_s=0.5)
    path = put(queue, "id:000000", b"first half, ")
    assert source.poll() == []  # old, but not yet seen unchanged
    with open(path, "ab") as f:
        f.write(b"second half")
    then = time.time() - 100
    os.utime(path, (then, then))
    assert source.poll() == []  # changed since the previous poll
    assert [f.input_bytes for f in source.poll()] == [b"first half, second half"]


def test_afl_file_whose_mtime_is_in_the_future_is_taken_once_unchanged(tmp_path, queue):
    """AFL++ hard-links its -i seeds into the queue, so a seed keeps its own mtime: one ahead
    of this clock never grew old enough, and the seed was never run (nothing said so)."""
    source = AflQueueSource(tmp_path / "afl_out", "main", settle_s=30)
    put(queue, "id:000000,orig:seed", b"from the future", age_s=-600)
    assert source.poll() == []  # first seen: not known to be unchanged yet
    assert names(source.poll()) == ["id:000000,orig:seed"]


def test_afl_deduplicates_by_content(tmp_path, queue):
    put(queue, "id:000000", b"same bytes")
    put(queue, "id:000001", b"same bytes")
    put(queue, "id:000002", b"other bytes")
    source = AflQueueSource(tmp_path / "afl_out", "main")
    assert names(source.poll()) == ["id:000000", "id:000002"]
    put(queue, "id:000003", b"same bytes")
    assert source.poll() == []


def test_afl_missing_directory_is_not_an_error(tmp_path):
    source = AflQueueSource(tmp_path / "afl_out", "main")
    assert source.poll() == []
    queue = tmp_path / "afl_out" / "main" / "queue"
    queue.mkdir(parents=True)
    put(queue, "id:000000", b"late")
    assert names(source.poll()) == ["id:000000"]


def test_afl_file_vanishing_before_it_settles_is_forgotten(tmp_path, queue):
    source = AflQueueSource(tmp_path / "afl_out", "main", settle_s=30)
    path = put(queue, "id:000000", b"first", age_s=0)
    assert source.poll() == []
    path.unlink()
    assert source.poll() == []
    put(queue, "id:000000", b"second")
    assert [n.input_bytes for n in source.poll()] == [b"second"]


@pytest.mark.parametrize("fuzzer", ["", "a/b", ".."])
def test_afl_rejects_bad_fuzzer_names(tmp_path, fuzzer):
    with pytest.raises(UsageError):
        AflQueueSource(tmp_path, fuzzer)


# ---------------------------------------------------------------------------------- tasks file


def write_lines(path: pathlib.Path, lines: list[str]) -> pathlib.Path:
    path.write_text("\n".join(lines) + "\n")
    return path


def test_jsonl_good_file(tmp_path):
    seed = tmp_path / "seed.bin"
    seed.write_bytes(b"\x00seed")
    tasks = write_lines(
        tmp_path / "tasks.jsonl",
        [
            json.dumps({"path": "/data/a", "target_branch": 5, "s2f_actions": [[5, "solve"]]}),
            "",
            "   ",
            json.dumps({"data": {"n": 3}}),
            json.dumps({"path": "b", "input_file": str(seed), "schedule_prefix": [1, 2]}),
        ],
    )
    found = list(load_tasks_jsonl(tasks))
    assert [t.payload for t in found] == [
        {"path": "/data/a", "target_branch": 5, "s2f_actions": [[5, "solve"]]},
        {"data": {"n": 3}},
        {"path": "b", "schedule_prefix": [1, 2]},
    ]
    assert [t.input_bytes for t in found] == [None, None, b"\x00seed"]
    assert found[1].origin == f"{tasks}:4"
    # a file of nothing would start a campaign of nothing, which then blocks the corrected file
    for lines in ([], [""], ["", "   ", "\t"]):
        path = write_lines(tmp_path / "empty.jsonl", lines)
        says = "is empty" if path.stat().st_size == 0 else r"holds no tasks \(only blank lines\)"
        with pytest.raises(UsageError, match=says):
            load_tasks_jsonl(path)


def test_a_tasks_file_is_encoded_twice_per_line_from_check_to_row(tmp_path, monkeypatch):
    """The import's parse computes the canonical form it stores: one JSON encoding per line
    there (there were four, a fifth of a million-line import), one more in the check that
    holds nothing (holding the tasks cost 1.5 KB a line), and the same row."""
    from store import semantic
    from store.campaign import Store
    from store.tasks import enqueue_tasks

    lines = [json.dumps({"data": {"n": i}, "target_branch": i + 1}) for i in range(50)]
    encoded = []
    real = semantic.canonical_json
    monkeypatch.setattr(semantic, "canonical_json", lambda v: encoded.append(v) or real(v))
    found = load_tasks_jsonl(write_lines(tmp_path / "tasks.jsonl", lines))
    store = Store.open(tmp_path / "c.db")
    try:
        with store.transaction() as tx:
            ids = enqueue_tasks(tx, (i.as_task() for i in found))  # as the runtime does
        assert len(encoded) == 2 * len(lines) == 2 * len(ids)
        with store.reading() as conn:
            rows = conn.exec_driver_sql("SELECT semantic_id, payload FROM tasks ORDER BY id")
            assert [tuple(r) for r in rows] == [
                (semantic.semantic_id(json.loads(line)), real(json.loads(line)))
                for line in lines]
    finally:
        store.close()


def test_a_tasks_file_holds_nothing_and_is_refused_if_changed_before_the_import(tmp_path):
    """The tasks are read from the file as they are imported, not held from the check on: a
    file changed in between (lines the check never saw) fails the import's transaction,
    which then imports nothing."""
    from store.campaign import Store
    from store.tasks import enqueue_tasks

    path = tmp_path / "tasks.jsonl"
    path.write_bytes(b'{"data": 1}\r{"data": 2}\r\n\n{"data": 3}')  # lines as splitlines() cuts
    found = load_tasks_jsonl(path)
    assert len(found) == 3
    assert [t.origin for t in found] == [f"{path}:1", f"{path}:2", f"{path}:4"]
    assert [t.payload for t in found] == [{"data": 1}, {"data": 2}, {"data": 3}]  # again
    with path.open("ab") as f:
        f.write(b'\n{"data": 4')  # a generator still writing it
    store = Store.open(tmp_path / "c.db")
    try:
        with pytest.raises(UsageError, match=r"changed after it was checked; nothing of it"), \
                store.transaction() as tx:
            enqueue_tasks(tx, (i.as_task() for i in found))
        with store.reading() as conn:
            assert conn.exec_driver_sql("SELECT count(*) FROM tasks").scalar() == 0
        # Written to while it is imported: refused at its end, inside the transaction.
        path.write_bytes(b'{"data": 1}\n{"data": 2}\n')
        found = load_tasks_jsonl(path)
        with pytest.raises(UsageError, match=r"changed while it was imported"), \
                store.transaction() as tx:
            def appending():
                for i, task in enumerate(found):
                    if i == 0:
                        with path.open("ab") as f:
                            f.write(b'\n{"data": 5}\n{"data": 6}\n')
                    yield task.as_task()
            enqueue_tasks(tx, appending())
        with store.reading() as conn:
            assert conn.exec_driver_sql("SELECT count(*) FROM tasks").scalar() == 0
    finally:
        store.close()


@pytest.mark.parametrize(
    "bad_line, reason",
    [
        ("[1, 2]", "not a JSON object"),
        ('"just a string"', "not a JSON object"),
        ('{"path": "x"', "not valid JSON"),
        ('{"path": "x", "data": NaN}', "not valid JSON"),
        ('{"focus_bytes": [1]}', "needs 'path' or 'data'"),
        ('{"path": 7}', "'path' must be a non-empty string"),
        ('{"path": "a", "path": "b"}', "duplicate key 'path'"),
        ('{"path": "x", "input_file": 3}', "'input_file' must be a non-empty string"),
        # the store's payload checks, run at load time so that the line is named
        ('{"path": "x", "focus_bytes": "abc"}', "focus_bytes must be a list of integers"),
        ('{"path": "x", "s2f_actions": [[1, "fly"]]}', "s2f_actions"),
        ('{"data": ' + "[" * 5000 + "]" * 5000 + "}", "nested too deeply"),
        ('{"data": "\\ud800"}', "surrogate"),
        # stored, then failing every send of its task (and taking the master down)
        ('{"data": {"n": 1180591620717411303424}}', "out of range"),
        ('{"path": "x", "schedule_prefix": [-9223372036854775809]}', "out of range"),
        ('{"path": "x", "continuation": {"k": [[18446744073709551616]]}}', "out of range"),
    ],
)
def test_jsonl_bad_line_is_reported_with_its_number_and_nothing_returned(tmp_path, bad_line,
                                                                        reason):
    tasks = write_lines(tmp_path / "tasks.jsonl", ['{"path": "a"}', "", bad_line, '{"path": "b"}'])
    with pytest.raises(TaskFileError) as err:
        load_tasks_jsonl(tasks)
    assert err.value.lineno == 3
    assert reason in err.value.reason
    assert str(err.value).startswith(f"{tasks}:3: ")
    assert isinstance(err.value, UsageError)


def test_jsonl_message_format(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    write_lines(tmp_path / "tasks.jsonl", ['{"path": "a"}'] * 6 + ["[]"])
    with pytest.raises(TaskFileError, match=r"^tasks\.jsonl:7: not a JSON object$"):
        load_tasks_jsonl("tasks.jsonl")


def test_jsonl_unknown_key_is_named(tmp_path):
    tasks = write_lines(tmp_path / "tasks.jsonl", ['{"path": "a", "priority": 3}'])
    with pytest.raises(TaskFileError, match="unknown key 'priority'") as err:
        load_tasks_jsonl(tasks)
    assert err.value.lineno == 1


def test_jsonl_missing_input_file_names_the_line(tmp_path):
    tasks = write_lines(
        tmp_path / "tasks.jsonl",
        ['{"data": 1}', json.dumps({"path": "a", "input_file": str(tmp_path / "nope")})],
    )
    with pytest.raises(TaskFileError, match=r":2: cannot read input_file") as err:
        load_tasks_jsonl(tasks)
    assert err.value.lineno == 2


def test_jsonl_invalid_utf8_names_the_line(tmp_path):
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_bytes(b'{"path": "a"}\n{"path": "\xff"}\n')
    with pytest.raises(TaskFileError, match=":2: not valid UTF-8"):
        load_tasks_jsonl(tasks)


def test_jsonl_accepts_a_byte_order_mark(tmp_path):
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_bytes(b'\xef\xbb\xbf{"path": "a"}\r\n{"path": "b"}\r\n')
    assert [t.payload["path"] for t in load_tasks_jsonl(tasks)] == ["a", "b"]


def test_jsonl_missing_file(tmp_path):
    with pytest.raises(UsageError, match="cannot read tasks file"):
        load_tasks_jsonl(tmp_path / "absent.jsonl")


# ----------------------------------------------------------------------------------------- demo


def test_demo_tasks():
    tasks = demo_tasks(3)
    assert [t.payload for t in tasks] == [{"data": {"n": i}} for i in range(3)]
    assert all(t.input_bytes is None and t.origin == "demo" for t in tasks)
    assert len(tasks) == 3 and list(demo_tasks(0)) == []
    with pytest.raises(ValueError):
        demo_tasks(-1)


def test_an_input_file_that_is_not_a_regular_file_is_refused(tmp_path):
    """A FIFO would block the start for ever (and /dev/zero fill the memory)."""
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    tasks = write_lines(tmp_path / "t.jsonl", [json.dumps({"path": "x", "input_file": str(fifo)})])
    with pytest.raises(TaskFileError, match=r"t.jsonl:1: input_file .* is not a regular file"):
        load_tasks_jsonl(tasks)


def test_an_input_file_of_the_campaign_the_master_holds_is_refused_unread(tmp_path):
    """A tasks file made by `find corpus -type f` with the campaign in corpus/ named the
    database as an input: the master read it through a descriptor of its own, and closing
    that dropped SQLite's POSIX locks (the next shell to close the file would delete the -wal
    under the master). The files of a campaign the process holds are refused, by any name."""
    from store.campaign import Store

    db = tmp_path / "c.db"
    (tmp_path / "alias").symlink_to(db)
    store = Store.open(db)
    try:
        for name in ("c.db", "alias", "c.db-wal", "c.db-shm"):
            tasks = write_lines(tmp_path / "t.jsonl", [json.dumps(
                {"path": "x", "input_file": str(tmp_path / name)})])
            with pytest.raises(TaskFileError, match=r"t.jsonl:1: input_file .* is a file of "
                                                    r"the campaign's database .*c\.db"):
                list(load_tasks_jsonl(tasks))
    finally:
        store.close()
    # Released, it is a file like any other (the lock's registry forgets it).
    [task] = load_tasks_jsonl(write_lines(tmp_path / "t.jsonl", [json.dumps(
        {"path": "x", "input_file": str(db)})]))
    assert task.input_bytes == db.read_bytes()


def test_an_input_too_big_to_store_is_refused_by_name_and_the_others_go_on(tmp_path, queue,
                                                                           capsys):
    """An input is stored with its task; one over SQLite's 1 GB stopped the master with
    'database write failed', and again at every start while that AFL entry was there (the
    entries beside it never became tasks). A sparse file stands for the big one."""
    from coordinator.sources import MAX_INPUT_BYTES
    put(queue, "id:000000", b"fine")
    huge = put(queue, "id:000001", b"")
    os.truncate(huge, MAX_INPUT_BYTES + 1)
    os.utime(huge, (time.time() - 100, time.time() - 100))
    source = AflQueueSource(tmp_path / "afl_out", "main", settle_s=0.5)
    assert names(source.poll()) == ["id:000000"]
    assert "id:000001 skipped: 268,435,457 bytes, over the 256 MiB" in capsys.readouterr().err
    assert source.poll() == [] and capsys.readouterr().err == ""  # said once
    tasks = write_lines(tmp_path / "t.jsonl", [json.dumps({"path": "a", "input_file": str(huge)})])
    with pytest.raises(TaskFileError, match=r"t\.jsonl:1: input_file .*: 268,435,457 bytes, over"):
        load_tasks_jsonl(tasks)


def test_a_file_where_the_afl_queue_should_be_is_said_once(tmp_path, capsys):
    """It was taken for a queue AFL had not created yet: the run waited for ever, silent."""
    (tmp_path / "afl_out" / "main").mkdir(parents=True)
    (tmp_path / "afl_out" / "main" / "queue").write_text("not a directory")
    source = AflQueueSource(tmp_path / "afl_out", "main", settle_s=0.5)
    assert source.poll() == [] and source.poll() == []
    assert capsys.readouterr().err.count("cannot read the AFL queue") == 1
    # ... and the start does not also say it waits for the queue to be created
    assert afl_queue_missing(tmp_path / "afl_out", "main") is None
    assert "does not exist yet" in afl_queue_missing(tmp_path / "afl_out", "other")
    (tmp_path / "afl_out" / "other" / "queue").mkdir(parents=True)
    assert afl_queue_missing(tmp_path / "afl_out", "other") is None


def test_afl_entries_that_are_not_regular_files_are_skipped_counted_and_never_read(
        tmp_path, queue, capsys):
    """As root, a symbolic link in the queue to /etc/passwd was read, stored in the campaign
    and its derived test cases written out. A link, a pipe, a link to a directory and a
    directory are skipped, counted and said (the last two were skipped in silence); only the
    regular entry is read."""
    secret = tmp_path / "secret"
    secret.write_bytes(b"root:x:0:0")
    (queue / "id:000001,link").symlink_to(secret)
    os.mkfifo(queue / "id:000002,fifo")
    (queue / "id:000003,dirlink").symlink_to(tmp_path)
    (queue / "id:000004,dir").mkdir()
    put(queue, "id:000000", b"real")
    old = time.time() - 100
    for name in ("id:000001,link", "id:000002,fifo"):
        os.utime(queue / name, (old, old), follow_symlinks=False)
    source = AflQueueSource(tmp_path / "afl_out", "main")
    found = source.poll()
    assert names(found) == ["id:000000"] and [f.input_bytes for f in found] == [b"real"]
    assert source.skipped == 4
    err = capsys.readouterr().err
    assert "id:000001,link skipped: a symbolic link, not a regular file" in err
    assert "id:000002,fifo skipped: a named pipe, not a regular file" in err
    assert "id:000003,dirlink skipped: a symbolic link, not a regular file" in err
    assert "id:000004,dir skipped: a directory, not a regular file" in err
    assert source.poll() == [] and source.skipped == 4  # each said once
    assert capsys.readouterr().err == ""
