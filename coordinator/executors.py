"""What a worker rank runs for one task.

Nothing here knows about MPI, tokens or the store: an executor turns one semantic task (plus its
input bytes, if the master shipped them) into an :class:`ExecOutcome`. A failing target or a
raising user callable is an *outcome*, never an exception, because the worker must always send
exactly one RESULT per dispatch (docs/protocol.md R1); only programming errors raise.
"""

from __future__ import annotations

import copy
import hashlib
import importlib
import importlib.util
import inspect
import json
import os
import pathlib
import shutil
import signal
import stat
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, NoReturn, Protocol, runtime_checkable

from .config import EXECUTOR_KINDS, MAX_TIMEOUT_S, RunConfig
from .errors import UsageError
from .processes import (
    COMMAND_MARK,
    MPI_JOB_VARIABLES,
    die_with_parent,
    kill_command,
    kill_marked,
    running_commands,
    started_ticks,
    wait_exit_unreaped,
)
from .wire import (
    ENCODE_ERRORS,
    MAX_TESTCASE_NAME_CHARS,
    MAX_TESTCASES,
    MAX_VALUE_BYTES,
    NOT_RUN_STATUS,
    clip_detail,
    encode,
)

__all__ = [
    "CommandExecutor",
    "DemoExecutor",
    "ExecOutcome",
    "Executor",
    "PythonExecutor",
    "EXECUTOR_KINDS",
    "collatz_steps",
    "demo_digest",
    "make_executor",
    "not_run",
]

STATUS_OK = "ok"
STATUS_TIMEOUT = "timeout"
STATUS_ERROR = "error"

# Enough of a crashing target's stderr to see the reason, small enough for one RESULT message.
DETAIL_MAX_BYTES = 2048

@dataclass
class ExecOutcome:
    # "ok" | "timeout" | "error" (exception / nonzero exit / bad input) | "not_run" |
    # "interrupted" (`worker.cut_short`)
    status: str
    value: Any = None  # JSON-serialisable result (python/demo executors); None for command
    testcases: list[tuple[str, bytes]] = field(default_factory=list)  # (basename, content)
    returncode: int | None = None
    duration_s: float = 0.0
    detail: str = ""  # short human text: stderr tail, the exception, dropped-file counts
    #: Output files that were test cases but over the limits (or unreadable): not sent.
    dropped: int = 0


def not_run(what: str, exc: OSError) -> ExecOutcome:
    """A task this host could not run (NOT_RUN_STATUS: retried, never its result). The first
    line of its detail is the retry's reason, which `status` counts by its text: the error's
    name there, and its file only below."""
    return ExecOutcome(status=NOT_RUN_STATUS,
                       detail=clip_detail(f"{what}: {exc.strerror or type(exc).__name__}\n{exc}"))


@dataclass
class BatchOutcome:
    """A batch dispatch's outcomes, one per task in order. As an outcome of its own it is the
    batch's: it ran (`ok`), and holds no value or test cases of its own."""

    outcomes: list[ExecOutcome]
    status: str = "ok"
    value: Any = None
    testcases: list[tuple[str, bytes]] = field(default_factory=list)
    returncode: int | None = None
    detail: str = ""
    dropped: int = 0

    @property
    def duration_s(self) -> float:
        return sum(o.duration_s for o in self.outcomes)


@runtime_checkable
class Executor(Protocol):
    def run(self, task: dict, input_bytes: bytes | None, workdir: pathlib.Path) -> ExecOutcome: ...


def _join_detail(*parts: str) -> str:
    return clip_detail("\n".join(p for p in parts if p))


# --------------------------------------------------------------------------------------------
# command executor (SymCC targets and any other program)
# --------------------------------------------------------------------------------------------


class _TailReader(threading.Thread):
    """Drains a pipe and keeps only its last bytes.

    A pipe (rather than a file in workdir) bounds both memory and disk for targets that log
    without end; draining in a thread keeps a chatty target from blocking on a full pipe.
    """

    def __init__(self, stream: Any, keep: int) -> None:
        super().__init__(name="executor-stderr-tail", daemon=True)
        self._stream = stream
        self._keep = keep
        self._buf = bytearray()

    def run(self) -> None:
        try:
            while chunk := self._stream.read1(65536):
                self._buf += chunk
                if len(self._buf) > 2 * self._keep:
                    del self._buf[: -self._keep]
        except (OSError, ValueError):
            pass  # pipe closed under us: what we have is the tail
        finally:
            try:
                self._stream.close()
            except OSError:
                pass

    def text(self) -> str:
        return bytes(self._buf[-self._keep :]).decode("utf-8", errors="replace")


#: What the command executor keeps of a run's output files (the rest is dropped, and noted).
DEFAULT_MAX_FILES = 1000
DEFAULT_MAX_FILE_BYTES = 1 << 20
DEFAULT_MAX_TOTAL_BYTES = 64 << 20
#: A RESULT's bytes besides the test cases' contents: its detail (≤ 2,000 characters) and
#: other fields, then a name (≤ 255 bytes) and msgpack headers per file.
RESULT_FIXED_BYTES = 16 << 10
RESULT_PER_FILE_BYTES = 300


def output_limits(max_message_bytes: int) -> tuple[int, int, int]:
    """(max_files, max_file_bytes, max_total_bytes) for RESULTs that stay under the master's
    bound: the defaults, cut down for a small bound (at most half of it goes to the files'
    names and headers). UsageError if even one file cannot fit."""
    files = min(DEFAULT_MAX_FILES,
                (max_message_bytes // 2 - RESULT_FIXED_BYTES) // RESULT_PER_FILE_BYTES)
    total = min(DEFAULT_MAX_TOTAL_BYTES, max_message_bytes - RESULT_FIXED_BYTES
                - RESULT_PER_FILE_BYTES * max(files, 0))
    if files < 1 or total < 1:
        raise UsageError(f"--max-message-bytes {max_message_bytes} leaves no room for test "
                         f"cases with the command executor (it needs at least "
                         f"{2 * (RESULT_FIXED_BYTES + RESULT_PER_FILE_BYTES)} bytes)")
    return files, min(DEFAULT_MAX_FILE_BYTES, total), total


def resolve_program(program: str) -> str:
    """The command's program as an absolute path, checked once, when the executor is built.

    Every dispatch runs in a fresh directory of its own, so `./target_symcc` must be taken from
    the directory the run was started in, not from there; a bare name is looked up on PATH. A
    program that is missing or not executable is refused now (the run does not start) rather
    than failing every task with "cannot start"."""
    if not program:
        raise UsageError("the command after -- is empty (give the program, e.g. -- ./target @@)")
    if "@@" in program:
        raise UsageError(f"command {program!r}: `@@` (the input file) cannot be the program; "
                         f"put the program first, e.g. -- ./target @@")
    if os.sep in program or (os.altsep and os.altsep in program):
        path = os.path.abspath(program)
        if os.path.isdir(path):
            raise UsageError(f"command {program!r} is a directory ({path}), not a program")
        if not os.path.isfile(path):
            raise UsageError(f"command {program!r}: no such file ({path})")
        if not os.access(path, os.X_OK):
            raise UsageError(f"command {program!r} is not executable (chmod +x {path})")
        _refuse_a_script_without_interpreter(program, path)
        return path
    found = shutil.which(program)
    if found is None:
        raise UsageError(f"command {program!r} is not on PATH (give its path, e.g. "
                         f"./{program})")
    _refuse_a_script_without_interpreter(program, found)
    return os.path.abspath(found)


def _refuse_a_script_without_interpreter(program: str, path: str) -> None:
    """A text file without a `#!` line: a shell runs it, but the kernel cannot (ENOEXEC), so
    every task failed with "Exec format error", each committed as its `error` result. Only
    text is refused: a binary format other than ELF may be one binfmt_misc runs."""
    try:
        with open(path, "rb") as f:
            head = f.read(512)
    except OSError:
        return  # (executable but unreadable: exec may still work)
    if not head or head.startswith((b"#!", b"\x7fELF")) or b"\0" in head:
        return
    try:
        head.decode("utf-8")
    except UnicodeDecodeError as e:
        if e.start < len(head) - 4:  # (not just a character cut at the end of the read)
            return
    raise UsageError(f"command {program!r} ({path}) is a script without a `#!` line: it "
                     f"cannot be executed (Exec format error); make its first line e.g. "
                     f"`#!/bin/sh`, or name its interpreter: -- sh {program} @@")


class CommandExecutor:
    """Runs an external program once per task (the SymCC way).

    ``@@`` in ``argv`` becomes the input file path; without ``@@`` the input goes to stdin.
    The program runs in its own session, so on timeout the whole process group is killed.
    Regular files the program leaves directly in ``$SYMCC_OUTPUT_DIR`` become test cases,
    whatever the exit status (SymCC targets often exit nonzero after writing useful inputs).
    On a timeout the files written so far travel with the outcome: the run is retried, never
    committed, but the master keeps those test cases.
    """

    #: The target writes its test cases into SYMCC_OUTPUT_DIR: a fresh directory per dispatch.
    needs_workdir = True

    def __init__(
        self,
        argv: Sequence[str],
        timeout_s: float,
        max_files: int = DEFAULT_MAX_FILES,
        max_file_bytes: int = DEFAULT_MAX_FILE_BYTES,
        max_total_bytes: int = DEFAULT_MAX_TOTAL_BYTES,
        *,
        resolved: bool = False,
    ) -> None:
        """`resolved`: `argv[0]` is the absolute path the master resolved and checked, taken as
        it is (see `build_executor`)."""
        if isinstance(argv, (str, bytes)) or not argv:
            raise UsageError("command executor needs a non-empty argv list, "
                             "e.g. ['./target', '@@']")
        if not all(isinstance(a, str) for a in argv):
            raise UsageError(f"command argv must be a list of strings, got {list(argv)!r}")
        if not 0 < timeout_s <= MAX_TIMEOUT_S:
            # (An inherited SYMCC_TIMEOUT meets this check alone when a --resume takes the
            # campaign's command over: past the bound every run failed on its worker.)
            raise UsageError(f"the command's timeout (--timeout or SYMCC_TIMEOUT) must be > 0 "
                             f"and at most {MAX_TIMEOUT_S:,.0f} seconds, got {timeout_s:g}")
        for name, limit in (
            ("max_files", max_files),
            ("max_file_bytes", max_file_bytes),
            ("max_total_bytes", max_total_bytes),
        ):
            if not isinstance(limit, int) or isinstance(limit, bool) or limit < 1:
                raise UsageError(f"{name} must be a positive integer, got {limit!r}")
        if resolved and not os.path.isabs(argv[0]):
            raise UsageError(f"a resolved command must start with an absolute path, got "
                             f"{argv[0]!r}")
        self.argv = [argv[0] if resolved else resolve_program(argv[0]), *argv[1:]]
        self.timeout_s = float(timeout_s)
        self.max_files = max_files
        self.max_file_bytes = max_file_bytes
        self.max_total_bytes = max_total_bytes
        # The program's own path is never substituted (the start directory may contain "@@").
        self.uses_file_arg = any("@@" in a for a in self.argv[1:])
        self._runs = 0

    def run(self, task: dict, input_bytes: bytes | None, workdir: pathlib.Path) -> ExecOutcome:
        started = time.perf_counter()
        workdir = pathlib.Path(workdir).resolve()
        try:
            input_path = self._materialise_input(task, input_bytes, workdir)
            out_dir = workdir / "out"
            out_dir.mkdir(exist_ok=True)
        except ValueError as exc:  # the task's input is gone: its own outcome
            return ExecOutcome(
                status=STATUS_ERROR,
                duration_s=time.perf_counter() - started,
                detail=clip_detail(f"cannot materialise input: {exc}"),
            )
        except OSError as exc:  # a disk that cannot take it (full, read-only) fails any task
            return not_run("cannot materialise input", exc)
        outcome = self._execute(input_path, out_dir, workdir)
        outcome.testcases, outcome.dropped, dropped_note = self._collect(out_dir)
        outcome.detail = _join_detail(outcome.detail, dropped_note)
        outcome.duration_s = time.perf_counter() - started
        return outcome

    def _materialise_input(
        self, task: dict, input_bytes: bytes | None, workdir: pathlib.Path
    ) -> pathlib.Path:
        if input_bytes is not None:
            path = workdir / "input"
            path.write_bytes(input_bytes)
            return path
        raw = task.get("path") if isinstance(task, dict) else None
        if not isinstance(raw, str) or not raw:
            raise ValueError("task has neither input bytes nor a 'path'")
        # Absolute: the target runs with workdir as its cwd.
        path = pathlib.Path(raw).absolute()
        try:  # the task's own file: whatever is wrong with it is the task's outcome
            if not path.is_file():  # (first: opening a FIFO would block)
                raise ValueError(f"input file {raw!r} does not exist or is not a regular file")
            with open(path, "rb"):
                pass
        except OSError as e:
            raise ValueError(f"input file {raw!r} cannot be read: "
                             f"{e.strerror or type(e).__name__}") from None
        return path

    def _environment(self, input_path: pathlib.Path, out_dir: pathlib.Path,
                     mark: str) -> dict[str, str]:
        # Without the launcher's variables: a target that uses MPI would otherwise join the
        # job as this worker's rank (seen: `rank 1 size 2`, then the real rank 1 crashed in
        # MPI_Improbe and the run lost it). It starts as an MPI job of its own instead.
        env = {k: v for k, v in os.environ.items() if not k.startswith(MPI_JOB_VARIABLES)}
        env[COMMAND_MARK] = mark
        env["SYMCC_OUTPUT_DIR"] = str(out_dir)
        if env.get("SYMCC_MEMORY_INPUT", "").strip().lower() in ("1", "on", "yes", "true"):
            # The user's harness makes a buffer symbolic itself: SymCC refuses a file input
            # beside it ("Can't enable file and memory input at the same time").
            env.pop("SYMCC_INPUT_FILE", None)
        elif self.uses_file_arg:
            env["SYMCC_INPUT_FILE"] = str(input_path)
        else:
            # SymCC treats stdin as symbolic only while SYMCC_INPUT_FILE is unset; an inherited
            # value would silently make a stdin-mode run fully concrete.
            env.pop("SYMCC_INPUT_FILE", None)
        return env

    def _execute(
        self, input_path: pathlib.Path, out_dir: pathlib.Path, workdir: pathlib.Path
    ) -> ExecOutcome:
        argv = [self.argv[0], *(a.replace("@@", str(input_path)) for a in self.argv[1:])]
        try:
            # Closed in the `finally` below, after the child has it (it may not be opened at all).
            stdin_file = None if self.uses_file_arg else open(input_path, "rb")  # noqa: SIM115
        except OSError as exc:  # (checked readable just before: gone or changed since)
            return ExecOutcome(status=STATUS_ERROR,
                               detail=clip_detail(f"cannot open input for stdin: {exc}"))
        self._runs += 1
        mark = f"{os.getpid()}.{self._runs}"  # (unique on this host while the worker lives)
        running_commands.spawning = True
        try:
            proc = subprocess.Popen(
                argv,
                stdin=stdin_file if stdin_file is not None else subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                cwd=workdir,
                env=self._environment(input_path, out_dir, mark),
                start_new_session=True,
                close_fds=True,
                preexec_fn=die_with_parent,  # (no library is loaded in the child)
            )
        except OSError as exc:
            # The program was checked at the start and the task is only its input: no process
            # to be had (EAGAIN, ENOMEM), a program replaced or removed since (ETXTBSY,
            # ENOENT) is this host's failure, not the task's outcome.
            running_commands.spawned(None)
            return not_run(f"cannot start {argv[0]!r}", exc)
        except BaseException:
            running_commands.spawned(None)
            raise
        finally:
            if stdin_file is not None:
                stdin_file.close()
        since = started_ticks(proc.pid)
        running_commands.marks[proc.pid] = (mark, since)
        running_commands.spawned(proc.pid)
        tail = _TailReader(proc.stderr, DETAIL_MAX_BYTES)
        timed_out = True
        try:
            tail.start()
            timed_out = not self._wait(proc)
        finally:  # (whatever failed here, the target is not left running unsupervised)
            # Also ends anything the target left running after a normal exit: in its group,
            # and, by its mark, what left the group (a daemon outlived the whole job).
            kill_command(proc.pid)
            kill_marked(mark, since)
            running_commands.groups.discard(proc.pid)  # before the reap frees the id for reuse
            running_commands.marks.pop(proc.pid, None)
            returncode = proc.wait()
        # An escaped grandchild (own session) may hold the pipe open; don't wait on it forever.
        tail.join(timeout=2.0)
        stderr_tail = tail.text()
        if timed_out:
            return ExecOutcome(
                status=STATUS_TIMEOUT,
                returncode=returncode,
                detail=_join_detail(
                    f"timed out after {self.timeout_s:g} s; process group killed", stderr_tail),
            )
        if returncode != 0:
            return ExecOutcome(
                status=STATUS_ERROR,
                returncode=returncode,
                detail=_join_detail(_describe_exit(returncode), stderr_tail),
            )
        return ExecOutcome(status=STATUS_OK, returncode=0, detail=stderr_tail)

    def _wait(self, proc: subprocess.Popen) -> bool:
        if hasattr(os, "waitid"):
            return wait_exit_unreaped(proc, self.timeout_s)
        try:  # platforms without waitid: the group kill after a normal exit is best effort
            proc.wait(timeout=self.timeout_s)
            return True
        except subprocess.TimeoutExpired:
            return False

    def _collect(self, out_dir: pathlib.Path) -> tuple[list[tuple[str, bytes]], int, str]:
        """The test cases kept, how many were dropped over the limits, and the note."""
        try:
            with os.scandir(out_dir) as it:
                listed = list(it)
        except OSError as exc:
            return [], 0, f"cannot list output directory: {exc}"
        # Test cases are the regular files; a dot file (a temporary one), a directory, a
        # symlink (it could point anywhere on the worker's host) or a pipe is not one.
        entries = sorted((e for e in listed if not e.name.startswith(".")
                          and e.is_file(follow_symlinks=False)), key=lambda e: e.name)
        skipped = len(listed) - len(entries)
        kept: list[tuple[str, bytes]] = []
        total = 0
        dropped = {"count": 0, "too_big": 0, "unreadable": 0}
        for entry in entries:
            if len(kept) >= self.max_files or total >= self.max_total_bytes:
                dropped["count"] += 1
                continue
            try:
                content = _read_bounded(entry.path, self.max_file_bytes)
            except OSError:
                content = None
                dropped["unreadable"] += 1
            else:
                dropped["too_big"] += content is None
            if content is None:
                dropped["count"] += 1
                continue
            if total + len(content) > self.max_total_bytes:
                dropped["count"] += 1
                continue
            # A name that is not UTF-8 (bytes the target chose) cannot travel as a string;
            # it only ever names the file's source, so a readable stand-in will do.
            kept.append((entry.name.encode("utf-8", "surrogateescape")
                         .decode("utf-8", "backslashreplace"), content))
            total += len(content)
        notes = []
        if dropped["count"]:
            unreadable = f", {dropped['unreadable']} unreadable" if dropped["unreadable"] else ""
            notes.append(  # wire.DROPPED_NOTE: the master keeps it even for an ok result
                f"dropped {dropped['count']} of {len(entries)} output files "
                f"({dropped['too_big']} over {self.max_file_bytes} bytes{unreadable}; limits: "
                f"{self.max_files} files, {self.max_total_bytes} bytes in total)"
            )
        if skipped:
            notes.append(f"dropped {skipped} of {len(listed)} output entries (dot files, "
                         f"directories, symlinks and other entries that are not regular files)")
        return kept, dropped["count"], "\n".join(notes)


def _read_bounded(path: str, limit: int) -> bytes | None:
    """The file's bytes, or None if it is larger than ``limit``; OSError if unreadable."""
    # O_NOFOLLOW: the scandir check and this open must agree even if the target raced us;
    # O_NONBLOCK: a file swapped for a pipe meanwhile must not block the worker.
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0))
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(f"{path} is no longer a regular file")
        data = f.read(limit + 1)
    return None if len(data) > limit else data


def _describe_exit(returncode: int) -> str:
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        return f"target killed by {name}"
    return f"target exited with status {returncode}"


# --------------------------------------------------------------------------------------------
# python executor (generic task farms)
# --------------------------------------------------------------------------------------------


_SPEC_FORMS = "'module:function' or 'path/to/file.py:function'"


def _load_callable(spec: str) -> Callable[..., Any]:
    """Resolves a callable spec; every failure is a UsageError that names the spec."""
    try:
        return _resolve(spec)
    except UsageError as exc:
        raise UsageError(f"callable spec {spec!r}: {exc}") from exc.__cause__


def _resolve(spec: str) -> Callable[..., Any]:
    if not isinstance(spec, str):
        raise UsageError(f"must be a string like {_SPEC_FORMS}")
    where, _, attr_path = spec.rpartition(":")
    if not where or not attr_path:
        raise UsageError(f"must look like {_SPEC_FORMS}")
    if not ({"", os.getcwd()} & set(sys.path)):
        # `python -m coordinator` finds a module of the start directory, the `coordinator`
        # script did not: `mpiexec -n 8 coordinator run --callable mypkg.work:solve` failed.
        # Nor do the ranks `coordinator run` launches (`python -P`, `launcher.rank_command`).
        # A file's own imports of modules beside it in the start directory, too.
        sys.path.append(os.getcwd())  # last: it must not shadow what is installed
    try:
        module = _import_file(where) if _looks_like_file(where) else importlib.import_module(where)
    except UsageError:
        raise
    except (Exception, SystemExit) as exc:
        # An import runs arbitrary user code: any failure is a bad spec. SystemExit too: a
        # script's module-level argparse, say, is not the master's own exit.
        raise UsageError(f"cannot import {where!r}: {type(exc).__name__}: {exc}") from exc
    target: Any = module
    for part in attr_path.split("."):
        try:
            target = getattr(target, part)
        except AttributeError:
            raise UsageError(f"{where!r} has no attribute {attr_path!r}") from None
    if not callable(target):
        raise UsageError(f"{attr_path!r} is not callable")
    return target


def _looks_like_file(where: str) -> bool:
    return where.endswith(".py") or "/" in where or os.sep in where


def _import_file(where: str) -> Any:
    path = pathlib.Path(where).resolve()
    if not path.is_file():
        raise UsageError(f"file {where!r} does not exist"
                         + ("" if os.path.isabs(where) else f" ({path})"))
    # Its own imports of modules beside it, from whatever directory a --resume starts in
    # (the spec is stored absolute); last, as the start directory.
    if str(path.parent) not in sys.path:
        sys.path.append(str(path.parent))
    # A name unique per file, so two task files with the same stem do not replace each other.
    name = f"_coordinator_task_{path.stem}_{hashlib.sha256(str(path).encode()).hexdigest()[:12]}"
    if name in sys.modules:
        return sys.modules[name]
    module_spec = importlib.util.spec_from_file_location(name, path)
    if module_spec is None or module_spec.loader is None:
        raise UsageError(f"file {where!r} cannot be loaded as a Python module")
    module = importlib.util.module_from_spec(module_spec)
    # Registered before running it: dataclasses and pickling look the module up by name.
    sys.modules[name] = module
    try:
        module_spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def _wants_input_bytes(fn: Callable[..., Any]) -> bool:
    try:
        inspect.signature(fn).bind(None, None)
    except TypeError:
        return False
    except ValueError:  # no signature available (some builtins): call with the task only
        return False
    return True


#: A path in a detail's "raised at" line is cut to its last components past this length.
_WHERE_PATH_CHARS = 80


def _short_path(filename: str) -> str:
    """A frame's file as a detail shows it: relative to the start directory when under it,
    else as Python has it, cut to its last two components if long."""
    try:
        rel = os.path.relpath(filename)
    except (ValueError, OSError):  # (OSError: the working directory was removed)
        rel = filename
    if not rel.startswith(os.pardir) and not os.path.isabs(rel):
        filename = rel
    if len(filename) <= _WHERE_PATH_CHARS:
        return filename
    return os.path.join("…", *pathlib.PurePath(filename).parts[-2:])


def _frame_text(frame: traceback.FrameSummary) -> str:
    return f"{_short_path(frame.filename)}:{frame.lineno} in {frame.name}"


def _raised_at(exc: BaseException) -> str:
    """Where the callable raised `exc`: its innermost frame, and, when that is in another
    file (a library the callable called), the callable's own last frame, whence it came.
    The executor's own frames (the call, the os._exit stand-in) are left out."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__)
              if os.path.abspath(f.filename) != _THIS_FILE]
    if not frames:
        return ""
    where = f"raised at {_frame_text(frames[-1])}"
    own = [f for f in frames if f.filename == frames[0].filename]
    if own[-1] is not frames[-1]:
        where += f", called from {_frame_text(own[-1])}"
    return where


_THIS_FILE = os.path.abspath(__file__)


def _exception_detail(exc: BaseException) -> str:
    """`Type: message`, then where it was raised on a line of its own (the last line: what
    `status` shows with the first, and what a clipped detail keeps)."""
    try:
        where = _raised_at(exc)
    except Exception:  # (where it was raised is a help: never at the cost of what it was)
        where = ""
    return clip_detail(f"{type(exc).__name__}: {exc}" + (f"\n{where}" if where else ""))


def _split_testcases(value: Any) -> tuple[Any, list[tuple[str, bytes]]]:
    """Moves the contents of ``value["testcases"]`` (name -> bytes) out of a dict result.

    The value keeps the key, mapping each name to its content's SHA-256 (hex): the master
    writes a test case under a name of its own (the first 16 hex digits of that digest
    without --afl-out), and writes a content only once, so this is what ties a task to its
    files, whoever wrote them first."""
    if not isinstance(value, dict) or "testcases" not in value:
        return value, []
    raw = value["testcases"]
    if not isinstance(raw, dict):
        raise ValueError(
            f"result['testcases'] is reserved for test cases, a dict of name -> bytes, and "
            f"this one is {type(raw).__name__}: return such a value under another key, or "
            f"nested, e.g. {{\"value\": {{\"testcases\": ...}}}}")
    testcases: list[tuple[str, bytes]] = []
    for name, content in raw.items():
        if not isinstance(name, str) or not isinstance(content, (bytes, bytearray, memoryview)):
            raise ValueError(
                "result['testcases'] must map str names to bytes, got "
                f"{type(name).__name__} -> {type(content).__name__}"
            )
        if len(name) > MAX_TESTCASE_NAME_CHARS:
            raise ValueError(f"result['testcases'] has a name of {len(name)} characters, over "
                             f"the {MAX_TESTCASE_NAME_CHARS} the master takes")
        testcases.append((name, bytes(content)))
    rest = {k: v for k, v in value.items() if k != "testcases"}
    # Only the names the master can keep (MAX_TESTCASES a RESULT): 30,000 names and their
    # digests made a value over MAX_VALUE_BYTES, an `error` where the files were kept.
    rest["testcases"] = {name: hashlib.sha256(content).hexdigest()
                         for name, content in testcases[:MAX_TESTCASES]}
    if len(testcases) > MAX_TESTCASES:
        rest["testcases_omitted"] = len(testcases) - MAX_TESTCASES
    return rest, testcases


def _as_json(value: Any) -> Any:
    """The value as the master will see it, or ValueError if it is not strict JSON."""
    try:
        text = json.dumps(value, allow_nan=False)
    except (TypeError, ValueError, RecursionError) as exc:
        raise ValueError(f"result is not JSON-serialisable: {type(exc).__name__}: {exc}") from None
    # The master refuses the whole RESULT for a value over its bound; said here, it is the
    # task's own error, not an invalid RESULT retried until the task is deferred. (A value's
    # msgpack is at most about twice its JSON text, for lists of floats: only a text over a
    # quarter of the bound is encoded to be measured.)
    loaded = json.loads(text)
    if len(text) > MAX_VALUE_BYTES // 4:
        try:
            size = len(encode(loaded))
        except ENCODE_ERRORS:
            size = 0  # (what cannot be sent is said by the worker's sender)
        if size > MAX_VALUE_BYTES:
            raise ValueError(f"result is {size} bytes encoded, over the {MAX_VALUE_BYTES} a "
                             f"value may have: return bulk output as test cases")
    return loaded


class CallableExited(BaseException):
    """`os._exit` called by a task's callable in the worker's own process (a BaseException,
    like SystemExit, so the callable's own `except Exception` does not swallow it)."""

    def __init__(self, code: object) -> None:
        super().__init__(f"the callable called os._exit({code!r}); the worker stayed")


class PythonExecutor:
    """Calls ``fn(task)`` (or ``fn(task, input_bytes)`` if it takes two arguments) per task.

    There is no timeout: the call runs in the worker's own process. Use the command executor
    for work that may hang.

    The callable's ``os._exit`` is the task's failure, as ``sys.exit`` is: under ULFM, Open
    MPI reports a rank that leaves with status 0 or by a signal as failed, but one that leaves
    with another status not at all, so the rank would vanish unseen until the watchdog. A
    process the callable forks still exits for real.
    """

    #: Runs in-process and writes no files: the worker's own scratch directory will do.
    needs_workdir = False

    def __init__(self, spec: str) -> None:
        self.spec = spec
        self.fn = _load_callable(spec)
        self.pass_input_bytes = _wants_input_bytes(self.fn)

    def run(self, task: dict, input_bytes: bytes | None, workdir: pathlib.Path) -> ExecOutcome:
        started = time.perf_counter()
        # A copy, so a callable that mutates its task cannot change what the worker reports.
        args: tuple[Any, ...] = (copy.deepcopy(task),)
        if self.pass_input_bytes:
            args += (input_bytes,)
        real_exit, pid, thread = os._exit, os.getpid(), threading.get_ident()
        calling = [True]

        def exit_in_call(code: int) -> NoReturn:
            # Only the call itself: a child the callable forked (multiprocessing ends them
            # so), another thread (a watchdog Timer) or a reference kept past the call exits
            # for real, as it would without the worker.
            if not calling[0] or os.getpid() != pid or threading.get_ident() != thread:
                real_exit(code)
            raise CallableExited(code)

        os._exit = exit_in_call
        try:
            result = self.fn(*args)
        # Workers ignore SIGINT, so a KeyboardInterrupt here was raised by the callable itself:
        # like SystemExit, it is the task's failure, not a reason for the worker to stop.
        # Anything else the call raises too (GeneratorExit, asyncio.CancelledError, a class
        # of the user's own): a BaseException out of here used to take the rank down. A
        # teardown signal ends the process itself (`processes.real_exit`), never through here.
        except BaseException as exc:
            return ExecOutcome(
                status=STATUS_ERROR,
                duration_s=time.perf_counter() - started,
                detail=_exception_detail(exc),
            )
        finally:
            calling[0] = False
            os._exit = real_exit
        duration = time.perf_counter() - started
        try:
            value, testcases = _split_testcases(result)
            value = _as_json(value)
        except ValueError as exc:
            return ExecOutcome(status=STATUS_ERROR, duration_s=duration,
                               detail=clip_detail(str(exc)))
        return ExecOutcome(status=STATUS_OK, value=value, testcases=testcases, duration_s=duration)


# --------------------------------------------------------------------------------------------
# demo executor (built-in workload for trying the farm without a target)
# --------------------------------------------------------------------------------------------

DEMO_DIGEST_ROUNDS = 64
# Collatz is only known to terminate in practice; bound n so a hostile task cannot spin forever.
DEMO_MAX_N = 1 << 64


def demo_digest(n: int) -> str:
    digest = f"demo:{n}".encode()
    for _ in range(DEMO_DIGEST_ROUNDS):
        digest = hashlib.sha256(digest).digest()
    return digest.hex()


def collatz_steps(n: int) -> int:
    steps = 0
    while n > 1:
        n = n // 2 if n % 2 == 0 else 3 * n + 1
        steps += 1
    return steps


def _burn_cpu(work_ms: float) -> None:
    deadline = time.perf_counter() + work_ms / 1000.0
    block = b"burn"
    while time.perf_counter() < deadline:
        for _ in range(64):
            block = hashlib.sha256(block).digest()


class DemoExecutor:
    """Deterministic built-in workload: task ``{"data": {"n": n}}`` -> digest and Collatz steps.

    A task without ``data.n`` but with an input (bytes or ``path``) gets ``n`` derived from the
    SHA-256 of that input, so AFL-style tasks work too.
    """

    #: Runs in-process and writes no files: the worker's own scratch directory will do.
    needs_workdir = False

    def __init__(self, work_ms: float = 0.0) -> None:
        if not work_ms >= 0:
            raise UsageError(f"demo work must be >= 0 ms, got {work_ms!r}")
        self.work_ms = float(work_ms)

    def run(self, task: dict, input_bytes: bytes | None, workdir: pathlib.Path) -> ExecOutcome:
        started = time.perf_counter()
        try:
            n = self._task_number(task, input_bytes)
        except (OSError, ValueError) as exc:
            return ExecOutcome(status=STATUS_ERROR, duration_s=time.perf_counter() - started,
                               detail=clip_detail(str(exc)))
        if self.work_ms > 0:
            _burn_cpu(self.work_ms)
        value = {"n": n, "digest": demo_digest(n), "collatz_steps": collatz_steps(n)}
        return ExecOutcome(status=STATUS_OK, value=value, duration_s=time.perf_counter() - started)

    @staticmethod
    def _task_number(task: dict, input_bytes: bytes | None) -> int:
        data = task.get("data") if isinstance(task, dict) else None
        if isinstance(data, dict) and "n" in data:
            n = data["n"]
            if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n < DEMO_MAX_N:
                raise ValueError(f"demo task needs data.n as an integer in [0, 2**64), got {n!r}")
            return n
        if input_bytes is None:
            path = task.get("path") if isinstance(task, dict) else None
            if not isinstance(path, str) or not path:
                raise ValueError("demo task needs data.n, input bytes or a 'path'")
            input_bytes = pathlib.Path(path).read_bytes()
        return int.from_bytes(hashlib.sha256(input_bytes).digest()[:4], "big") % 1_000_000 + 1


# --------------------------------------------------------------------------------------------


def make_executor(
    kind: str,
    *,
    argv: Sequence[str] | None = None,
    callable_spec: str | None = None,
    timeout_s: float = 30.0,
    demo_work_ms: float = 0.0,
    max_message_bytes: int | None = None,
    resolved: bool = False,
) -> Executor:
    """Builds the executor a worker uses; UsageError explains a bad combination of options.

    `max_message_bytes` is the master's bound on a RESULT: the command executor keeps the
    test cases it sends under it (dropping the rest, and saying so), instead of sending a
    message the master must quarantine whole."""
    if kind == "command":
        if callable_spec is not None:
            raise UsageError("a command executor takes a command line, not a callable spec")
        if demo_work_ms:
            raise UsageError("demo work time only applies to the demo executor")
        if not argv:
            raise UsageError("the command executor needs a command line, e.g. -- ./target_symcc @@")
        if max_message_bytes is None:
            return CommandExecutor(list(argv), timeout_s, resolved=resolved)
        files, per_file, total = output_limits(max_message_bytes)
        return CommandExecutor(list(argv), timeout_s, max_files=files, max_file_bytes=per_file,
                               max_total_bytes=total, resolved=resolved)
    if kind == "python":
        if argv:
            raise UsageError("a python executor takes a callable spec, not a command line")
        if demo_work_ms:
            raise UsageError("demo work time only applies to the demo executor")
        if not callable_spec:
            raise UsageError("the python executor needs a callable spec like 'module:function'")
        return PythonExecutor(callable_spec)
    if kind == "demo":
        if argv or callable_spec is not None:
            raise UsageError("the demo executor takes neither a command line nor a callable spec")
        return DemoExecutor(demo_work_ms)
    raise UsageError(f"unknown executor kind {kind!r}; choose one of {', '.join(EXECUTOR_KINDS)}")


def build_executor(cfg: RunConfig, argv: list[str] | None = None) -> Executor:
    """The run's executor. `argv`: the command as the master resolved it, so that every
    worker runs the program the master checked (a bare name on another node's PATH could be
    another binary). Taken as it is, unchecked: the program may be missing or not executable
    here and now (a node without it, a rebuild in place, another rank's run that took its
    exec bit), and refusing it then left the job, which without ULFM aborts every rank's work.
    Each task this node cannot start answers `not_run` instead, and the master rests the rank
    (`coordinator.cooldown`) while the healthy ones run its tasks."""
    return make_executor(cfg.executor, argv=argv or cfg.argv, callable_spec=cfg.callable_spec,
                         timeout_s=cfg.timeout_s, demo_work_ms=cfg.demo_work_ms,
                         max_message_bytes=cfg.max_message_bytes, resolved=bool(argv))
