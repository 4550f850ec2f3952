"""What can refuse a run, checked before any rank does work.

`coordinator run` checks it before it launches MPI, so a missing tasks file, a bad callable, a
foreign or locked database, an output directory another campaign's master writes to or an
existing campaign without `--resume` is said in a fraction of a second instead of after an MPI
start of 2-8 s; the master checks it again (the file may have changed meanwhile, and under the
user's own `mpiexec` nobody checked before). Nothing here writes: the database is only read
(`store.campaign.probe`), and so is the output directory's lock (`output_lock.check_free`).
"""

from __future__ import annotations

import dataclasses
import os
import stat
from dataclasses import dataclass
from pathlib import Path

from store.errors import CampaignExistsError, CampaignLockedError, CampaignRowMissing
from store.imports import Imported, demo_imported, file_identity, file_imported
from store.lock import refuse_read_only
from store.probe import Probe, probe

from .config import (
    AFL_NEEDS_COMMAND,
    DEFAULT_DEMO_TASKS,
    DEFAULT_TIMEOUT_S,
    MAX_TIMEOUT_S,
    RUN_SETTINGS,
    ConfigError,
    RunConfig,
    default_feedback,
    default_watchdog,
    how_it_runs,
    how_stored,
    refuse_overwriting,
    setting_text,
)
from .errors import UsageError
from .executors import EXECUTOR_KINDS, build_executor
from .output import TestcaseWriter
from .output_lock import check_free


@dataclass(frozen=True)
class Checked:
    cfg: RunConfig            # as the run goes: a --resume takes what the campaign stores
    argv: list[str] | None    # the command as resolved (its program's absolute path)
    notes: list[str]          # what the start says besides (what a --resume took over)
    probe: Probe
    #: An earlier import of this run's tasks file, unchanged since, or of demo tasks: what
    #: a --resume need not read again (the master imports what is past it, if anything).
    known: Imported | None = None


def check_run(cfg: RunConfig) -> Checked:
    """Raises a StoreError or UsageError for whatever would refuse the run."""
    found = probe(cfg.db)
    refuse_read_only(cfg.db)
    # A running master first: "pass --resume" would only lead to this refusal.
    if found.master is not None:
        raise CampaignLockedError(
            f"{cfg.db} is in use by a running master (pid {found.master}) or a `coordinator "
            f"db upgrade`; stop it first (`kill -TERM {found.master}` stops a master "
            f"gracefully), or choose another --db path")
    if found.campaign and not cfg.resume:
        raise CampaignExistsError(str(cfg.db), found.tasks)
    notes: list[str] = []
    if cfg.resume and found.revision is not None and not found.campaign:
        # The schema without its campaign row: a copy made without its -wal, or a file whose
        # first start died between its schema and its campaign row (Store.open commits them
        # one after the other), which the fault campaign's start-up crashes reach and which
        # must go on. The two look alike, so the run goes on, saying so loudly.
        notes.append(CampaignRowMissing(cfg.db, resume=True).message)
    given_spec = cfg.callable_spec
    if cfg.resume and found.campaign:
        cfg, notes = take_over(cfg, found.settings)
        refuse_overwriting(cfg)  # the callable the campaign stored is this run's now
    if cfg.demo is None and cfg.tasks_file is None and cfg.afl_out is None \
            and not found.campaign:
        # A --resume of a file that holds no campaign yet starts a new one: the embedded
        # default is the demo executor's alone.
        if cfg.executor != "demo":
            raise UsageError(
                f"--resume: {cfg.db} holds no campaign yet, and {how_it_runs(cfg)} needs "
                f"tasks: add --tasks FILE or --afl-out DIR")
        cfg = dataclasses.replace(cfg, demo=DEFAULT_DEMO_TASKS)
    if cfg.executor == "demo" and cfg.afl_out is not None:
        # A --resume --afl-out without a command, on a campaign that has none to take.
        raise ConfigError(AFL_NEEDS_COMMAND)
    if cfg.tasks_file is not None:
        _check_tasks_file(cfg.tasks_file)
    try:
        argv = getattr(build_executor(cfg), "argv", None)
    except UsageError as e:
        if cfg.callable_spec is not None and cfg.callable_spec != given_spec:
            # Not the one on the command line: the user must hear where it came from.
            raise UsageError(
                f"{e}; that is the campaign's callable, as its last run stored it in "
                f"{cfg.db} (relative to the directory that run started in, if relative): "
                f"give --callable to run another") from e
        raise
    writer(cfg)
    check_free(*output_directory(cfg), db=cfg.db)
    return Checked(cfg, argv, notes, found, _imported_before(cfg, found))


def _imported_before(cfg: RunConfig, found: Probe) -> Imported | None:
    if not (cfg.resume and found.campaign):
        return None
    if cfg.tasks_file is not None:
        source, identity = file_identity(cfg.tasks_file)  # (checked readable just before)
        return file_imported(found.imports, source, identity)
    if cfg.demo is not None:
        return demo_imported(found.imports)
    return None


def take_over(cfg: RunConfig, stored: dict | None) -> tuple[RunConfig, list[str]]:
    """A --resume that does not name the executor (or, for an AFL campaign, the queue) runs
    the campaign's own, as its last run stored them, and says so; one that names another is
    for `config.check_resume` to judge (a real conflict is refused there)."""
    if not stored:  # (a file begun before revision 0004, never resumed since)
        _refuse_unknown_settings(cfg, {})
        return cfg, []
    notes = []
    kind = stored.get("executor")
    if not cfg.executor_given and kind in EXECUTOR_KINDS and kind != cfg.executor:
        _refuse_demo_tasks(cfg, stored)
        cfg = dataclasses.replace(
            cfg, executor=kind, executor_given=True,
            callable_spec=stored.get("callable") if kind == "python" else None,
            argv=[str(a) for a in stored.get("command") or []] if kind == "command" else [],
            # (the kind's default, for a campaign that kept no feedback setting)
            feedback=cfg.feedback if "feedback" in cfg.given else default_feedback(kind))
        notes.append(f"--resume runs the campaign's own executor, as its last run did: "
                     f"{how_it_runs(cfg)}")
    if (stored.get("source") == "afl" and cfg.afl_out is not None and "name" not in cfg.given
            and isinstance(stored.get("name"), str) and stored["name"] != cfg.name):
        # A moved AFL directory given again without --name: the campaign's instance name, not
        # the default (its test cases would go to another directory, their ids from 0).
        cfg = dataclasses.replace(cfg, name=stored["name"])
        notes.append(f"--resume keeps the campaign's --name {cfg.name}, as its last run had it")
    if (stored.get("source") == "afl" and stored.get("afl_out") and stored.get("fuzzer")
            and cfg.afl_out is None and cfg.tasks_file is None and cfg.demo is None):
        cfg = dataclasses.replace(cfg, afl_out=Path(str(stored["afl_out"])),
                                  fuzzer=str(stored["fuzzer"]),
                                  name=str(stored.get("name") or cfg.name))
        _refuse_vanished_afl_out(cfg)
        notes.append(f"--resume watches the campaign's own AFL queue, as its last run did: "
                     f"--afl-out {cfg.afl_out} --fuzzer {cfg.fuzzer} --name {cfg.name}")
    _refuse_unknown_settings(cfg, stored)
    kept = {key: stored[key] for key in RUN_SETTINGS
            if key not in cfg.given and key in stored and stored[key] != getattr(cfg, key)
            and _valid_setting(key, stored[key])}
    if kept:
        cfg = dataclasses.replace(cfg, **kept)
        if "timeout_s" in kept and "watchdog_s" not in cfg.given:
            cfg = dataclasses.replace(cfg, watchdog_s=default_watchdog(cfg.timeout_s))
        notes.append("--resume keeps the campaign's " + " ".join(
            setting_text(k, v) for k, v in kept.items()) + ", as its last run had them")
    return cfg, notes


def _refuse_unknown_settings(cfg: RunConfig, stored: dict) -> None:
    """A campaign begun by a version that kept none of RUN_SETTINGS (before 2026-12-03): what
    its runs used cannot be known, and this version's defaults were taken for them and stored
    for good. Measured on upgraded campaigns: a command's `--max-depth 1` became unlimited
    (1,913 tasks at depth 15, never ending, where the same flags gave 282), and a callable's
    feedback, on for every executor then, went off unsaid. Such a `--resume` must give each
    setting that matters to its executor once; it is kept from then on."""
    if cfg.executor == "demo":
        return  # (it writes no test cases and has no timeout)
    unknown = [k for k in RUN_SETTINGS if k not in stored and k not in cfg.given]
    feedback = stored.get("feedback", cfg.feedback if "feedback" in cfg.given else None)
    needed = [k for k in unknown
              if k == "feedback" or (k == "max_depth" and feedback is not False)
              or (k == "timeout_s" and cfg.executor == "command")]
    if not needed:
        return
    defaults = {"feedback": "--feedback or --no-feedback (this version's default: "
                            + ("on" if default_feedback(cfg.executor) else "off")
                            + f" for a {'command' if cfg.executor == 'command' else 'callable'};"
                              " the older versions': on)",
                "max_depth": "--max-depth N (0: unlimited, the default)",
                "timeout_s": f"--timeout S (the default: {DEFAULT_TIMEOUT_S:g}, or "
                             f"SYMCC_TIMEOUT)"}
    raise UsageError(
        f"--resume: {cfg.db} was begun by an older coordinator version, which did not keep "
        f"the campaign's {', '.join(RUN_SETTINGS[k] for k in needed)}: what its runs used "
        f"cannot be told, and this version's defaults may differ. Give "
        f"{'; '.join(defaults[k] for k in needed)} on this --resume, as its runs had them; "
        f"they are kept from then on. Nothing was changed")


def _refuse_vanished_afl_out(cfg: RunConfig) -> None:
    """The AFL output directory a --resume took from the campaign, gone (moved away): the
    run waited for its fuzzer's queue for ever, saying only that AFL may not run yet, and
    made the vanished path again for its own test cases (`output_lock`, the writer), which
    AFL never reads. An AFL starting makes its queue inside an output directory that is
    there (`-o` of a resumed AFL, or made by the job script): only the queue is waited for."""
    assert cfg.afl_out is not None
    if os.path.lexists(cfg.afl_out):
        return
    raise UsageError(
        f"--resume: the campaign's AFL output directory {cfg.afl_out} (--afl-out of its last "
        f"run) no longer exists; if it was moved, pass --afl-out NEW --fuzzer {cfg.fuzzer} to "
        f"watch it there from now on (the campaign keeps --name {cfg.name}); nothing was "
        f"created")


def _refuse_demo_tasks(cfg: RunConfig, stored: dict) -> None:
    """The demo payloads are the demo executor's alone, as for a new campaign (`config`):
    `--resume --demo 10` on a command's campaign added 10 tasks committed as `error` for
    ever (a demo task has no input file), and on a callable's tasks file or AFL queue it fed
    them to the callable unasked. A callable's campaign started on demo payloads (`--callable
    X --demo N`) takes more of them, and naming the callable again says the user means it, as
    for a new campaign."""
    if cfg.demo is None:
        return
    kind = stored.get("executor")
    if kind == "command":
        raise UsageError(
            f"--demo: {cfg.db} runs its tasks with a command ({how_stored(stored)}), which runs on "
            f"each task's input file, and --demo tasks have none: give it --tasks FILE "
            f"(payloads with a \"path\") or --afl-out DIR")
    if kind == "python" and stored.get("source") != "demo":
        raise UsageError(
            f"--demo: {cfg.db} runs its tasks with {how_stored(stored)}; --demo would feed it "
            f"{cfg.demo} built-in demo payloads: give it --tasks FILE, or name the callable "
            f"again (--callable {stored.get('callable')}) if that is what you mean")


def _valid_setting(key: str, value: object) -> bool:
    """A stored value this code can run with (the file may come from another version)."""
    if key == "feedback":
        return isinstance(value, bool)
    if key == "max_depth":
        return type(value) is int and value >= 0
    return (isinstance(value, (int, float)) and not isinstance(value, bool)
            and 0 < value <= MAX_TIMEOUT_S)


def writer(cfg: RunConfig) -> TestcaseWriter:
    """The test-case writer; raises (a refusal) if its directory cannot be used. It creates
    and removes nothing: it reads its directory only once the master holds the campaign and
    that directory (`TestcaseWriter.scan`, `output_lock`)."""
    if cfg.afl_out is not None:
        return TestcaseWriter(cfg.afl_out / cfg.name / "queue", afl_style=True, scan=False,
                              afl_sync=(cfg.afl_out, cfg.name))
    return TestcaseWriter(output_directory(cfg)[0], afl_style=False, scan=False)


def output_directory(cfg: RunConfig) -> tuple[Path, str]:
    """The directory one campaign alone may write its test cases to (`output_lock`), and the
    flag that chooses another: with --afl-out the whole instance directory, since AFL keys
    what it imported by the instance's name, not by its queue."""
    if cfg.afl_out is not None:
        return cfg.afl_out / cfg.name, "--name"
    return cfg.out or cfg.db.with_name(cfg.db.name + ".out"), "--out"


def _check_tasks_file(path: Path) -> None:
    """The cheap part of a tasks file's check (its lines are checked as the master reads
    them): there, a regular file, readable."""
    try:
        st = os.stat(path)
        if not stat.S_ISREG(st.st_mode):
            raise UsageError(f"--tasks {path} is not a regular file; write the tasks to a file "
                             f"first (e.g. `gen > tasks.jsonl`)")
        with open(path, "rb"):
            pass
    except OSError as e:
        raise UsageError(f"cannot read tasks file {str(path)!r}: {e.strerror or e}") from None
