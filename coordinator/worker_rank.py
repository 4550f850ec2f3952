"""A worker rank's life: the start-up verdict, its executor and sender, then `worker.serve`
until STOP; and how a worker that cannot go on leaves the job."""

from __future__ import annotations

import dataclasses
import signal
import sys
import traceback

import msgspec

from .config import RunConfig
from .errors import UsageError
from .executors import build_executor, resolve_program
from .exits import ExitStatus
from .faults import FaultPlan, FaultySender
from .processes import STOP_SIGNALS, TEARDOWN_SIGNAL, exit_now
from .transport import MasterGone, Transport, worker_spin_default
from .wire import TAG_STOP, decode_start
from .worker import Sender, answer_stop, note_stop_signal, serve, torn_down


def run_worker_rank(cfg: RunConfig, transport: Transport) -> int:
    """A worker rank from the start-up verdict to its exit status."""
    # The master decides when the job stops: a terminal's Ctrl-C, or a batch system's SIGTERM
    # when the job is cancelled or out of time, reaches every rank, and the workers go on
    # with their tasks through the grace period. Caught by a handler that does nothing, not
    # ignored: an ignored signal stays ignored across exec, and the targets the command
    # executor starts could then not be stopped by Ctrl-C or SIGTERM at all.
    # Noted, for a command that such a signal killed too (`worker.cut_short`).
    for signum in STOP_SIGNALS:
        signal.signal(signum, note_stop_signal)
    signal.signal(TEARDOWN_SIGNAL, torn_down)  # the master gave up on this rank
    try:
        got = transport.wait_for_start()
        if got.tag == TAG_STOP:  # stopped before it started: nothing to finish
            return answer_stop(transport, got.data)
        try:
            start = decode_start(got.data)
        except msgspec.DecodeError as e:
            leave_job(transport, f"the master's start verdict cannot be decoded ({e})")
            raise  # not reached
        if start.status != ExitStatus.OK:  # the master refused to start: its exit status
            if transport.fault_tolerant:
                # The master refused to start and leaves without MPI_Finalize, which can hang
                # under ULFM after any rank's death (ompi#11404); the workers do the same.
                exit_now(start.status)
            return start.status
        cfg = dataclasses.replace(cfg, executor=start.executor or cfg.executor,
                                  callable_spec=start.callable,
                                  timeout_s=start.timeout_s or cfg.timeout_s)
        executor = build_executor(cfg, start.argv)
        if start.argv:
            say_if_not_runnable_here(transport.rank, start.argv[0])
        sender = Sender(transport, cfg.max_message_bytes)
        if cfg.inject:
            sender = FaultySender(transport, FaultPlan(cfg.inject, cfg.inject_seed,
                                                       cfg.inject_log), cfg.max_message_bytes)
        spin_s = (cfg.worker_spin_ms / 1000 if cfg.worker_spin_ms is not None
                  else worker_spin_default())
        return serve(transport, executor, sender=sender, spin_s=spin_s,
                     stop_wait_s=cfg.stop_wait_s)
    except MasterGone as e:  # nothing of this rank's own went wrong: no traceback
        print(f"rank {transport.rank}: the master is gone ({e}); exiting", file=sys.stderr,
              flush=True)
        exit_now(1)
    except BaseException:
        leave_job(transport)
        raise  # not reached


def say_if_not_runnable_here(rank: int, program: str) -> None:
    """One line when the program the master checked cannot be run on this rank's node now: the
    run goes on (its tasks here answer `not_run`, and the master rests this rank), but the
    operator should know which node to fix."""
    try:
        resolve_program(program)
    except UsageError as e:
        print(f"coordinator: rank {rank}: {e} on this node; its tasks here answer not_run "
              f"until it can run (the other ranks run them)", file=sys.stderr, flush=True)


def leave_job(transport: Transport, why: str | None = None) -> None:
    """A worker that cannot go on (its executor does not load here, a bug) must not return into
    MPI_Finalize: that waits for ranks that will never finalize, spinning, and the master is never
    told. Under ULFM it exits without finalizing, which the master sees as this rank's death (its
    task goes back to the queue, the run goes on with the others; only a zero exit status keeps Open
    MPI's launcher from ending the whole job). Without ULFM a rank's exit ends the job anyway: abort
    it."""
    # The one line first: it must reach the terminal even if the traceback does not.
    print(f"coordinator: rank {transport.rank} cannot go on and leaves the job "
          + (f"({why}; " if why else "(") + "the master returns any task it held to the queue)",
          file=sys.stderr, flush=True)
    if why is None:  # a known cause needs no traceback
        traceback.print_exc()
    if transport.fault_tolerant:
        exit_now(0)
    transport.abort(ExitStatus.INTERNAL)
