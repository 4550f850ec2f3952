"""Flags and `SYMCC_*` variables, validated once, with the flag winning over the variable."""

from __future__ import annotations

import argparse
import math
import os
from dataclasses import dataclass
from pathlib import Path

from .errors import UsageError

ENV_RESUME = "SYMCC_RESUME"
ENV_RETRIES = "SYMCC_DISPATCH_PROTOCOL_RETRIES"
ENV_MAX_ATTEMPTS = "SYMCC_DISPATCH_MAX_ATTEMPTS"
ENV_TIMEOUT = "SYMCC_TIMEOUT"
ENV_WATCHDOG = "SYMCC_DISPATCH_WATCHDOG_SEC"

DEFAULT_DEMO_TASKS = 300
#: The coordinator's AFL instance directory unless --name says another.
DEFAULT_NAME = "symcc"
DEFAULT_TIMEOUT_S = 30.0
#: How long the master waits for a write lock another process holds before it stops (exit 3):
#: an operator's shell or a backup on a multi-day campaign is not a failure.
DEFAULT_LOCK_WAIT_S = 1800.0


class ConfigError(UsageError):
    """A setting the user gave that cannot be used; the message names it."""


def int_range(lo: int, hi: int | None = None):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < lo or (hi is not None and value > hi):
            rng = f"{lo}..{hi}" if hi is not None else f">= {lo}"
            raise argparse.ArgumentTypeError(f"{value} is out of range ({rng})")
        return value
    return parse


def non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be >= 0")
    if value == math.inf:  # a time or an amount: inf would make every demo task run for ever
        raise argparse.ArgumentTypeError(f"{text!r} must be a finite number")
    return value


#: The shortest --start-wait: ranks take a second or more to start (the MPI library and
#: Python's imports); with less, every rank is lost before its first READY, and the run
#: ends at once as if all had died.
MIN_START_WAIT_S = 1.0


def path_arg(text: str) -> Path:
    """A path flag's value. An empty one is refused: Path("") is ".", so `--db ""` was said
    to be "--db . is a directory", and `--out ""` or `--afl-out ""` named the current one."""
    if not text:
        raise argparse.ArgumentTypeError("the path is empty")
    return Path(text)


def start_wait(text: str) -> float:
    value = non_negative_float(text)
    if value < MIN_START_WAIT_S:
        raise argparse.ArgumentTypeError(
            f"{text!r} is too short: ranks take a second or more to start, and a rank silent "
            f"that long is treated as lost (at least {MIN_START_WAIT_S:g})")
    return value


#: The longest command timeout: the wait counts milliseconds in a C int (24.8 days), and a
#: larger value failed every task with "OverflowError: timeout is too large".
MAX_TIMEOUT_S = 1_000_000.0


#: The executors a run can use (`executors.build_executor`). Here, not there: the CLI's parser
#: needs the names, and `coordinator status` should not load the executors to print a table.
EXECUTOR_KINDS = ("command", "python", "demo")


#: The most tasks one dispatch carries (the wire format's bound too).
MAX_BATCH = 1000


#: `--batch auto`: each dispatch sized from the tasks' measured run time.
AUTO_BATCH = "auto"


def batch_size(text: str) -> int | str:
    """`--batch N` (1..MAX_BATCH) or `auto` (AUTO_BATCH)."""
    if text == AUTO_BATCH:
        return AUTO_BATCH
    return int_range(1, MAX_BATCH)(text)


def dispatch_batch(batch: int | str | None, executor: str) -> int | None:
    """The tasks per dispatch the master uses (None: sized automatically). Unless `--batch`
    says otherwise, a command runs alone (a SymCC run takes seconds, and a batch would only
    hold its results back), and python and demo tasks are batched automatically
    (`batching.AutoBatch`): a task of microseconds would otherwise pay a whole durable round
    each, and a longer one goes alone unless dispatching costs its rank a noticeable share."""
    if batch is None:
        return 1 if executor == "command" else None
    return None if batch == AUTO_BATCH else int(batch)


def timeout_seconds(text: str) -> float:
    value = non_negative_float(text)
    if not 0 < value <= MAX_TIMEOUT_S:
        raise argparse.ArgumentTypeError(f"{text!r} must be > 0 and at most {MAX_TIMEOUT_S:,.0f} "
                                         f"seconds")
    return value


def _from_env(name: str, parse):
    """`name` from the environment through the flag's own parser (same checks, same words,
    prefixed with the variable); None if unset or empty."""
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return None
    try:
        return parse(raw)
    except argparse.ArgumentTypeError as e:
        raise ConfigError(f"{name}={e}") from None


_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def _env_flag(name: str) -> bool:
    """A yes/no variable: 1/true/yes/on or 0/false/no/off (unset or empty: no). Anything else
    is an error rather than a guess (`SYMCC_RESUME=false` must not resume)."""
    raw = os.environ.get(name, "").strip().lower()
    if raw in _TRUE:
        return True
    if raw in _FALSE or raw == "":
        return False
    raise ConfigError(f"{name}={os.environ[name]!r} is not a yes/no value "
                      f"(use 1, true, yes, on or 0, false, no, off)")


def _env_int(name: str, lo: int, hi: int | None) -> int | None:
    return _from_env(name, int_range(lo, hi))


def _env_float(name: str) -> float | None:
    return _from_env(name, non_negative_float)


@dataclass(frozen=True)
class RunConfig:
    db: Path
    resume: bool
    retries: int
    max_attempts: int | None  # None: the store's default for `retries`
    synchronous: str
    executor: str                  # command | python | demo
    #: Whether the command line chose the executor (--executor, --callable or a command): a
    #: --resume without one runs the campaign's own (`preflight`).
    executor_given: bool
    argv: list[str]
    callable_spec: str | None
    timeout_s: float
    watchdog_s: float
    demo: int | None
    tasks_file: Path | None
    afl_out: Path | None
    fuzzer: str | None
    name: str
    out: Path | None
    max_depth: int
    feedback: bool
    stats_file: Path
    stats_interval_s: float
    grace_s: float
    stall_grace_s: float
    #: --batch: tasks per dispatch, AUTO_BATCH, or None (the executor's default:
    #: `dispatch_batch`)
    batch: int | str | None
    start_wait_s: float
    lock_wait_s: float
    stop_wait_s: float
    max_message_bytes: int
    demo_work_ms: float
    worker_spin_ms: float | None  # None: by the MPI library (transport.worker_spin_default)
    progress: bool  # the live display
    inject: dict[str, float] | None = None
    inject_seed: int = 0
    inject_log: Path | None = None
    summary_json: Path | None = None
    master_pid_file: Path | None = None
    progress_interval_s: float = 0.0  # plain progress lines; 0: none
    metrics_file: Path | None = None
    #: Which of RUN_SETTINGS' fields (and `watchdog_s`) the command line or the environment
    #: set: a --resume takes the others from the campaign (`preflight.take_over`).
    given: frozenset[str] = frozenset()


def _same_directory(a: Path, b: Path) -> bool:
    try:
        return a.samefile(b)
    except OSError:  # one of them does not exist (yet): they are not the same one
        return False


#: The demo executor on AFL's inputs would commit made-up results, and tie the campaign to it.
AFL_NEEDS_COMMAND = ("--afl-out needs the command to run on AFL's inputs, e.g. "
                     "-- ./target_symcc @@ (or a --callable)")


def resolve_run(ns: argparse.Namespace) -> RunConfig:
    """Merge flags with the environment and check the combinations (raises ConfigError)."""
    resume = bool(ns.resume) or _env_flag(ENV_RESUME)
    retries = ns.retries if ns.retries is not None else _env_int(ENV_RETRIES, 0, 16)
    max_attempts = (ns.max_attempts if ns.max_attempts is not None
                    else _env_int(ENV_MAX_ATTEMPTS, 1, None))
    retries = 1 if retries is None else retries
    if max_attempts is not None and max_attempts <= retries:
        # The ceiling would hold a task as failed before its budget is spent: the budget the
        # user asked for would silently never be reached.
        given = ("--max-attempts" if ns.max_attempts is not None else ENV_MAX_ATTEMPTS)
        raise ConfigError(
            f"{given} {max_attempts} holds a task as failed before its {retries} immediate "
            f"retries (--retries / {ENV_RETRIES}) are used: give a ceiling above {retries}, or "
            f"leave it out (its default follows --retries)")
    # The command's limit: an inherited value no command uses must not refuse a demo or python
    # run (it still feeds the default watchdog).
    commands = ns.executor == "command" or (ns.executor is None and bool(ns.command))
    timeout = ns.timeout if ns.timeout is not None else _from_env(
        ENV_TIMEOUT, timeout_seconds if commands else non_negative_float)
    set_here = {"timeout_s"} if timeout is not None else set()
    timeout = DEFAULT_TIMEOUT_S if timeout is None else timeout
    watchdog = ns.watchdog if ns.watchdog is not None else _env_float(ENV_WATCHDOG)
    if watchdog is None:
        watchdog = default_watchdog(timeout)
    else:
        set_here.add("watchdog_s")
    set_here.update(k for k in ("max_depth", "feedback", "name") if getattr(ns, k) is not None)
    if ns.name is None:  # (None: not given; a --resume then keeps the campaign's)
        ns.name = DEFAULT_NAME

    argv = list(ns.command or [])
    if argv and argv[0] == "--":
        argv = argv[1:]
    sources = [s for s in (ns.demo is not None, ns.tasks is not None, ns.afl_out is not None)
               if s]
    if len(sources) > 1:
        raise ConfigError("choose one task source: --demo N, --tasks FILE or --afl-out DIR")
    demo = ns.demo
    if ns.afl_out is not None and not ns.fuzzer:
        raise ConfigError("--afl-out needs --fuzzer NAME (the AFL instance whose queue to read)")
    if ns.fuzzer and ns.afl_out is None:
        raise ConfigError("--fuzzer needs --afl-out DIR")
    for flag, value in (("--fuzzer", ns.fuzzer), ("--name", ns.name)):
        # A path here could name the fuzzer's own queue in another spelling ("main/",
        # "x/../main"): the coordinator would then feed its results back to itself for ever.
        if value is not None and (not value or "/" in value or value in (".", "..")):
            raise ConfigError(f"{flag} {value!r} must be a single directory name, like "
                              f"{'main' if flag == '--fuzzer' else 'symcc'}")
    if ns.afl_out is not None and ns.name.startswith("."):
        raise ConfigError(f"--name {ns.name!r}: AFL's sync skips directories whose name starts "
                          f"with '.', so it would import nothing (choose e.g. symcc)")
    if ns.afl_out is not None and any((ns.afl_out / ns.name / f).exists()
                                      for f in ("fuzzer_stats", "fuzzer_setup")):
        raise ConfigError(f"--name {ns.name!r}: {ns.afl_out / ns.name} is an AFL instance's own "
                          f"directory (it has fuzzer_stats); the coordinator needs one of its "
                          f"own (choose another --name)")
    if ns.fuzzer and ns.fuzzer == ns.name:
        raise ConfigError(f"--name {ns.name!r} is the fuzzer's own instance; the coordinator "
                          f"must write to its own directory (choose another --name)")
    if ns.fuzzer and _same_directory(ns.afl_out / ns.name / "queue",
                                     ns.afl_out / ns.fuzzer / "queue"):
        raise ConfigError(f"--name {ns.name!r}: {ns.afl_out / ns.name / 'queue'} is the "
                          f"fuzzer's own queue through a symbolic link; the coordinator would "
                          f"feed its results back to itself for ever (choose another --name)")
    if ns.tasks is not None and ns.tasks.exists() and not ns.tasks.is_file():
        # stdin, a pipe or a FIFO: the ranks of the job cannot read the launcher's stdin (the
        # master would wait on it for ever), and /dev/fd/N does not exist in them.
        raise ConfigError(f"--tasks {ns.tasks} is not a regular file; write the tasks to a "
                          f"file first (e.g. `gen > tasks.jsonl`)")
    if ns.out is not None and ns.afl_out is not None:
        raise ConfigError(f"--out is not used with --afl-out: new test cases go to "
                          f"{ns.afl_out}/{ns.name}/queue (choose the directory with --name)")
    if ns.afl_out is not None and ns.afl_out.exists() and not ns.afl_out.is_dir():
        raise ConfigError(f"--afl-out {ns.afl_out} is not a directory (AFL's -o directory)")

    executor = ns.executor
    executor_given = executor is not None or bool(argv) or ns.callable is not None
    if executor is None:
        executor = "command" if argv else "python" if ns.callable else "demo"
    if executor == "command" and not argv:
        raise ConfigError("the command executor needs a command after --, e.g. "
                          "-- ./target_symcc @@")
    if executor == "python" and not ns.callable:
        raise ConfigError("the python executor needs --callable module:function")
    if not sources and not resume:
        # The embedded default, a built-in demo workload, is the demo executor's alone: a
        # user's callable or command would run on 300 demo payloads and make a campaign of
        # 300 errors. (--resume continues the stored tasks; a new campaign under --resume is
        # checked once it is known to be new: `preflight`.)
        if executor == "python":
            raise ConfigError("--callable runs on tasks you give it: add --tasks FILE (one JSON "
                              "object per line) or --afl-out DIR (--demo N runs it on the N "
                              "built-in demo payloads)")
        if executor == "command":
            raise ConfigError("the command executor runs on each task's input file: add "
                              "--tasks FILE (payloads with a \"path\") or --afl-out DIR")
        demo = DEFAULT_DEMO_TASKS
    if executor == "command" and demo is not None:
        raise ConfigError("the command executor runs a command on each task's input file, and "
                          "--demo tasks have none: give it --tasks FILE (payloads with a "
                          "\"path\") or --afl-out DIR")
    if executor != "command" and argv:
        raise ConfigError(f"a command after -- is only used with --executor command "
                          f"(executor is {executor})")
    if executor == "demo" and ns.afl_out is not None and (executor_given or not resume):
        # (A --resume that names no executor runs the campaign's: judged once it is known,
        # `preflight`; a moved AFL directory is given again without its command.)
        raise ConfigError(AFL_NEEDS_COMMAND)

    if ns.db.is_dir() or ns.db.name in ("", ".", ".."):
        raise ConfigError(f"--db {ns.db} is a directory; it names the campaign's database "
                          f"file, e.g. --db {ns.db / 'campaign.db'}")
    stats_file = ns.stats_file or ns.db.with_name(ns.db.name + ".stats")
    for flag, path in (("--stats-file", ns.stats_file), ("--summary-json", ns.summary_json),
                       ("--metrics-file", ns.metrics_file)):
        # Written at the end: found out then, after the whole run.
        if path is None:
            continue
        where = path.absolute().parent
        if not where.is_dir():
            # (as `store.readonly.no_directory`: this module does not load the store)
            raise ConfigError(f"{flag} {path}: " + (f"{where} is not a directory"
                                                    if where.exists() else
                                                    f"the directory {where} does not exist"))
        if not os.access(where, os.W_OK | os.X_OK):  # a read-only mount too, even as root
            raise ConfigError(f"{flag} {path}: the directory {where} is not writable")
        if path.is_dir():
            raise ConfigError(f"{flag} {path} is a directory; it names the file to write")
    cfg = RunConfig(
        db=ns.db, resume=resume, retries=retries,
        max_attempts=max_attempts,
        synchronous=ns.synchronous, executor=executor, executor_given=executor_given,
        argv=argv, callable_spec=ns.callable,
        timeout_s=timeout, watchdog_s=watchdog, demo=demo, tasks_file=ns.tasks,
        afl_out=ns.afl_out, fuzzer=ns.fuzzer, name=ns.name, out=ns.out,
        max_depth=ns.max_depth or 0,
        feedback=ns.feedback if ns.feedback is not None else default_feedback(executor),
        given=frozenset(set_here), stats_file=stats_file,
        stats_interval_s=ns.stats_interval,
        grace_s=ns.grace, stall_grace_s=ns.stall_grace, start_wait_s=ns.start_wait, batch=ns.batch,
        lock_wait_s=ns.lock_wait, stop_wait_s=ns.stop_wait, max_message_bytes=ns.max_message_bytes,
        demo_work_ms=ns.demo_work_ms, worker_spin_ms=ns.worker_spin_ms,
        progress=bool(ns.progress),
        # A rank's stderr is a pipe or a file under mpiexec: without the live display (asked
        # for by the self-launcher when its own stderr is a terminal), plain lines.
        progress_interval_s=0.0 if ns.progress is not None else ns.progress_interval,
        metrics_file=ns.metrics_file,
        inject=ns.inject, inject_seed=ns.inject_seed, inject_log=ns.inject_log,
        summary_json=ns.summary_json, master_pid_file=ns.master_pid_file,
    )
    refuse_overwriting(cfg)
    refuse_foreign_files(cfg)
    return cfg


#: What SQLite keeps beside a database (as `store.lock.SIDE_FILES`, which a worker, loading
#: this module, must not import: its start stays free of the store).
_SIDE_FILES = ("-wal", "-shm", "-journal")


def _same_file(a: Path, b: Path) -> bool:
    """As `store.lock.same_file` (see `_SIDE_FILES` for why not that one)."""
    if os.path.realpath(a) == os.path.realpath(b):
        return True
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def exit_status_path(pid_file: Path) -> Path:
    """Where the master of a self-launched job records the status it ends with, beside its
    pid. The launcher reports that status, not mpiexec's, which is the first rank's to end
    abnormally (128 + SIGUSR2 for a hung rank the master ended) or, under ULFM, often 0."""
    return pid_file.with_name(pid_file.name + ".exit")


def refuse_overwriting(cfg: RunConfig) -> None:
    """The files a run writes must not be the campaign's database (or what SQLite keeps
    beside it), its tasks file or its callable's file, nor one another: `--stats-file
    campaign.db` replaced the database with 445 bytes of text, `--summary-json tasks.jsonl`
    the tasks. Each is written through `NAME.tmp`, which must not be one of them either.
    Checked again once a --resume has taken the campaign's stored callable (`preflight`)."""
    real_db = Path(os.path.realpath(cfg.db))  # (SQLite keeps -wal and -shm beside the target)
    kept = [("--db", cfg.db)]
    for base in {cfg.db, real_db}:
        kept += [(f"--db's {side}", base.with_name(base.name + side)) for side in _SIDE_FILES]
    if cfg.tasks_file is not None:
        kept.append(("--tasks", cfg.tasks_file))
    if cfg.callable_spec and ":" in cfg.callable_spec:
        module = cfg.callable_spec.rsplit(":", 1)[0]
        if module.endswith(".py"):
            kept.append(("--callable's file", Path(module)))
    pid_file = cfg.master_pid_file
    written = [(flag, path) for flag, path in (
        ("--stats-file", cfg.stats_file), ("--summary-json", cfg.summary_json),
        ("--metrics-file", cfg.metrics_file), ("--out", cfg.out),
        ("--master-pid-file", pid_file),
        ("--master-pid-file's exit status", pid_file and exit_status_path(pid_file)),
    ) if path is not None]
    for i, (flag, path) in enumerate(written):
        tmp = path.with_name(path.name + ".tmp")
        for other, name in kept + written[:i]:
            for mine in (path, tmp) if flag != "--out" else (path,):
                if _same_file(mine, name):
                    raise ConfigError(f"{flag} {path} would overwrite {name} ({other}"
                                      + (f", through {mine}" if mine is tmp else "")
                                      + "); choose another path")


#: The first bytes of every SQLite database (its file format's header).
_SQLITE_HEADER = b"SQLite format 3\x00"
#: How the files this code writes begin (`store.stats.stats_text`, `metrics.metrics_text`): an
#: existing file that begins otherwise is someone else's.
_STATS_START = b"Quarantined worker results: "
_METRICS_START = b"# HELP coordinator_"
#: A key every --summary-json has held since the flag exists (`master_rank`).
_SUMMARY_KEY = "committed_this_run"
#: Past this size a file is not one of ours (a summary is ~1 KB, a metrics file ~10 KB).
_SNIFF_BYTES = 1 << 20


def _looks_like(head: bytes) -> str:
    """What an existing file seems to hold, for a refusal to name."""
    if _SQLITE_HEADER in head:
        return "an SQLite database (a campaign's?)"
    if b"\x00" in head:
        return "binary data"
    first = head.split(b"\n", 1)[0].strip()
    if first.startswith(b"{"):
        return "JSON (a tasks file?)"
    return f"text starting {first[:40].decode('utf-8', 'replace')!r}"


def _summary_of_ours(head: bytes) -> bool:
    import json
    try:
        doc = json.loads(head)
    except ValueError:
        return False
    return isinstance(doc, dict) and _SUMMARY_KEY in doc


def refuse_foreign_files(cfg: RunConfig) -> None:
    """A --stats-file, --metrics-file or --summary-json that names an existing file holding
    something else than that flag writes is refused: each is replaced whole, and `--stats-file
    other.db` destroyed another campaign's database with exit 0. A missing or empty file, or
    one this flag wrote before (the same command run again), is taken."""
    for flag, path, ours, what in (
        ("--stats-file", cfg.stats_file, lambda h: h.startswith(_STATS_START),
         "the stats text a run writes"),
        ("--metrics-file", cfg.metrics_file, lambda h: h.startswith(_METRICS_START),
         "a coordinator's metrics"),
        ("--summary-json", cfg.summary_json, _summary_of_ours, "a run's summary"),
    ):
        if path is None or not os.path.exists(path):
            continue
        if not path.is_file():
            # A FIFO would block the read below, and a device (/dev/null) would be replaced by
            # a regular file at the end of the run.
            raise ConfigError(f"{flag} {path} is not a regular file; it names the file to "
                              f"write (choose another path)")
        with open(path, "rb") as f:
            head = f.read(_SNIFF_BYTES + 1)
        if not head or (len(head) <= _SNIFF_BYTES and _SQLITE_HEADER not in head
                        and ours(head)):
            continue
        raise ConfigError(f"{flag} {path} exists and holds {_looks_like(head)}, not "
                          f"{what}: the run would replace it; choose another path (or remove "
                          f"the file if it is not needed)")


#: How a campaign's tasks run, kept from its last run: a --resume that does not give one
#: keeps the campaign's (a job script's bare `--resume` had turned `--no-feedback` into
#: unbounded feedback: 3 queued tasks became 3,993). RunConfig field -> its flag.
RUN_SETTINGS = {"feedback": "--feedback", "max_depth": "--max-depth", "timeout_s": "--timeout"}


def default_feedback(executor: str) -> bool:
    """Feedback unless --feedback/--no-feedback says: on for a command (a SymCC target's test
    cases are new inputs), off for a callable, whose test cases are its bulk output (fed back,
    each became a task `{"path": ...}` the callable was never written for, and without
    --max-depth maybe for ever), and for the demo, which writes none."""
    return executor == "command"


def default_watchdog(timeout_s: float) -> float:
    return max(120.0, 4 * timeout_s)


def campaign_settings(cfg: RunConfig) -> dict[str, object]:
    """What a campaign keeps of its runs (campaign.settings), for `check_resume` and
    `preflight.take_over`: its first run's executor kind and task source, and its last run's
    command or callable, AFL directories and RUN_SETTINGS (`renewed_settings`)."""
    source = ("afl" if cfg.afl_out is not None else "tasks" if cfg.tasks_file is not None
              else "demo")
    return {"executor": cfg.executor, "callable": stored_callable(cfg.callable_spec),
            "command": stored_command(cfg.argv) or None,
            "source": source,
            "afl_out": str(cfg.afl_out.absolute()) if cfg.afl_out is not None else None,
            "fuzzer": cfg.fuzzer, "name": cfg.name if cfg.afl_out is not None else None,
            **{key: getattr(cfg, key) for key in RUN_SETTINGS}}


def _by_path(program: str) -> bool:
    """A program named by a path (`./target`, `bin/target`), not a bare name PATH finds."""
    return os.sep in program or bool(os.altsep and os.altsep in program)


def stored_command(argv: list[str]) -> list[str]:
    """The command as a campaign keeps it: a program named by a relative path made absolute
    (from the directory the run starts in, as the master resolves it: `executors`), since a
    --resume from another directory found no `./target.sh` there, or ran another program of
    that name. A bare name stays as given: PATH finds it wherever the run starts."""
    if not argv or not _by_path(argv[0]):
        return list(argv)
    return [os.path.abspath(argv[0]), *argv[1:]]


def stored_callable(spec: str | None) -> str | None:
    """The callable as a campaign keeps it: one given by its file (`work.py:solve`, as
    `executors._looks_like_file` tells) with that file's absolute path, as for a command's
    program (`stored_command`): a --resume from another directory found no `work.py`."""
    if not spec or ":" not in spec:
        return spec
    where, attr = spec.rsplit(":", 1)
    if not (where.endswith(".py") or "/" in where or os.sep in where):
        return spec  # a module: found on sys.path wherever the run starts
    return f"{os.path.abspath(where)}:{attr}"


def _same_command(stored: object, given: object) -> bool:
    """Whether a --resume's command is the one the campaign stored. One that campaigns kept
    before programs were stored absolute (`./target.sh`) is its program's path from here,
    where such a --resume finds it (as before)."""
    if stored is None or stored == given:
        return True
    if not isinstance(stored, list) or not stored or not isinstance(given, list):
        return False
    return stored_command([str(a) for a in stored]) == given


def setting_text(key: str, value: object) -> str:
    """A run setting as its flag: `--no-feedback`, `--max-depth 2`, `--timeout 60`."""
    if key == "feedback":
        return "--feedback" if value else "--no-feedback"
    return f"{RUN_SETTINGS[key]} {value:g}" if isinstance(value, float) else \
        f"{RUN_SETTINGS[key]} {value}"


def how_it_runs(cfg: RunConfig) -> str:
    """The executor as the command line gives it: `--callable X`, `-- CMD ...`, or none."""
    return how_stored(campaign_settings(cfg))


def how_stored(s: dict) -> str:
    """As `how_it_runs`, for the settings a campaign stored (campaign.settings)."""
    if s.get("executor") == "python":
        return f"--callable {s.get('callable')}"
    if s.get("executor") == "command":
        return "-- " + " ".join(s.get("command") or [])
    return "the demo executor (no --callable and no command)"


def check_resume(cfg: RunConfig, stored: dict | None) -> list[str]:
    """Refuse a --resume that would run the campaign differently from its earlier runs in a way
    that commits wrong results for good: another executor (a forgotten `--callable` runs every
    stored task through the demo executor, which fails them all), or an AFL campaign resumed
    without its `--afl-out` (its results would no longer reach AFL). Another callable or
    command of the same kind, or more tasks from another source, are the user's call.

    Returns what the user should hear all the same: another callable or command; an AFL
    campaign resumed with another
    `--afl-out`, `--fuzzer` or `--name` (a typo in `--name` starts a second instance
    directory that AFL then syncs from; a moved AFL directory is a good reason)."""
    if stored is None:  # from before revision 0004: this start's settings become the record
        return []
    given = campaign_settings(cfg)
    if stored.get("executor") not in (None, given["executor"]):
        raise ConfigError(
            f"{cfg.db} runs its tasks with the {stored.get('executor')} executor "
            f"({how_stored(stored)}); this --resume would use the {given['executor']} executor "
            f"({how_stored(given)}): give the campaign's executor again (or choose a new --db)")
    if stored.get("source") == "afl" and given["source"] != "afl":
        raise ConfigError(
            f"{cfg.db} watches an AFL queue (--afl-out {stored.get('afl_out')} --fuzzer "
            f"{stored.get('fuzzer')} --name {stored.get('name')}); give them again on --resume, "
            f"or its results would not reach AFL")
    notes = []
    key = {"python": "callable", "command": "command"}.get(given["executor"])
    if key is not None and not (_same_command(stored.get(key), given[key]) if key == "command"
                                else stored.get(key) in (None, given[key])
                                or stored_callable(str(stored.get(key))) == given[key]):
        # The user's call (a fixed target, a renamed module), but results committed from now
        # on come from another program than the earlier ones: said, not refused.
        notes.append(f"this campaign's earlier runs used {how_stored(stored)}; this --resume runs "
                     f"{how_stored(given)}")
    if stored.get("source") != "afl" or given["source"] != "afl":
        return notes

    def same(key: str) -> bool:
        was, now = stored.get(key), given[key]
        if key == "afl_out" and was is not None and now is not None:  # ../afl is /x/afl
            return Path(str(was)).resolve() == Path(str(now)).resolve()
        return was is None or was == now

    changed = [f"--{key.replace('_', '-')} {stored.get(key)} (now {given[key]})"
               for key in ("afl_out", "fuzzer", "name") if not same(key)]
    if changed:
        notes.append(f"this campaign last ran with {', '.join(changed)}; its new test cases "
                     f"now go to {cfg.afl_out / str(given['name']) / 'queue'} and it reads "
                     f"{cfg.afl_out / str(given['fuzzer']) / 'queue'}")
    return notes


def renewed_settings(cfg: RunConfig, stored: dict | None) -> dict[str, object]:
    """What a --resume that `check_resume` let through changes in campaign.settings: the
    command or callable it runs, an AFL campaign's --afl-out, --fuzzer and --name, and the
    RUN_SETTINGS it gave. Without this, a later bare `--resume` went back to the first run's:
    the target before its fix, or an AFL directory that was moved away (its queue waited for
    for ever). The executor's kind and the task source stay the first run's."""
    if stored is None:  # (the store then keeps this start's whole)
        return {}
    given = campaign_settings(cfg)
    keys = [*RUN_SETTINGS, {"python": "callable", "command": "command"}.get(
        str(given["executor"]), "")]
    if stored.get("source") == "afl" and given["source"] == "afl":
        keys += ["afl_out", "fuzzer", "name"]
    return {k: given[k] for k in keys if k in given and given[k] != stored.get(k)}


def describe(cfg: RunConfig) -> str:
    """The run's task source, executor and batches, for the master's first line."""
    src = (f"{cfg.demo} demo tasks" if cfg.demo is not None else
           f"tasks from {cfg.tasks_file}" if cfg.tasks_file else
           f"AFL queue {cfg.afl_out}/{cfg.fuzzer}/queue" if cfg.afl_out is not None else
           "the campaign's stored tasks")
    batch = dispatch_batch(cfg.batch, cfg.executor)
    per = ("" if batch == 1 else ", batches sized from the measured run times (--batch auto)"
           if batch is None
           else f", up to {batch} tasks per dispatch")
    return f"{src}, {cfg.executor} executor{per}"
