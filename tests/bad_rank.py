"""A misbehaving rank for the tests: launched MPMD beside the coordinator

    mpiexec -n 1 coordinator run ... : -n 1 python bad_rank.py MODE [ARG] : -n 2 coordinator run ...

it waits for the master's start verdict like a worker, does what MODE says (a hostile or just
a broken worker build), and then, unless MODE says otherwise, behaves as an honest worker that
answers WORK with an `ok` RESULT and READY and acknowledges STOP, so the run can end on its
own. It speaks the wire format with msgspec (never pickle) and MPI through mpi4py's buffer
calls, as the coordinator does.
"""

from __future__ import annotations

import os
import pickle
import sys
import time

import msgspec
from mpi4py import MPI

from coordinator.wire import (
    TAG_READY,
    TAG_RESULT,
    TAG_START,
    TAG_STOP,
    TAG_STOP_ACK,
    TAG_WORK,
    Ready,
    Result,
    Stop,
    decode_stop,
    decode_work,
    encode,
)

comm = MPI.COMM_WORLD
comm.Set_errhandler(MPI.ERRORS_RETURN)
RANK = comm.Get_rank()
MODE = sys.argv[1]
ARG = sys.argv[2] if len(sys.argv) > 2 else ""


def recv(tags: tuple[int, ...], source: int = 0) -> tuple[int, bytearray]:
    status = MPI.Status()
    while True:
        for tag in tags:
            msg = comm.Improbe(source=source, tag=tag, status=status)
            if msg is not None:
                buf = bytearray(status.Get_elements(MPI.BYTE))
                msg.Recv([buf, MPI.BYTE])
                return tag, buf
        time.sleep(0.001)


def send(data: bytes | bytearray, tag: int, dest: int = 0) -> None:
    comm.Send([data, MPI.BYTE], dest=dest, tag=tag)


def ready(token: str = "", pid: int | None = None) -> bytes:
    return encode(Ready(rank=RANK, bitmap_version=0, empirical_profile_version="",
                        completed_dispatch_token=token, host=os.uname().nodename,
                        pid=os.getpid() if pid is None else pid))


def honest(first_ready: bool = True, forged_acks: int = 0, deaf: bool = False) -> None:
    """A worker that takes nothing it is given seriously but answers everything right
    (`forged_acks`: that many STOP_ACKs for no STOP first, when its STOP comes; `deaf`: its
    STOP never acknowledged, answered with garbage on every tag the master receives until
    the job ends it)."""
    if first_ready:
        send(ready(), TAG_READY)
    while True:
        tag, data = recv((TAG_STOP, TAG_WORK))
        if tag == TAG_STOP and deaf:
            while True:
                for tag in (TAG_RESULT, TAG_READY, TAG_STOP_ACK, 99):
                    send(b"\xc1garbage", tag)
        if tag == TAG_STOP:
            for i in range(forged_acks):
                send(encode(Stop(token=f"{i:064x}")), TAG_STOP_ACK)
            send(encode(Stop(token=decode_stop(data).token)), TAG_STOP_ACK)
            os._exit(0)
        token = decode_work(data).token
        send(answer(token), TAG_RESULT)
        send(ready(token), TAG_READY)


def answering(results, first: bytes | None = None) -> None:
    """Sends `first` (an idle READY by default), then answers every WORK with the RESULTs
    `results(token)` gives and the READY echoing its token, or, when it gives None, holds
    the WORK unanswered. Acknowledges STOP when it comes."""
    send(ready() if first is None else first, TAG_READY)
    while True:
        tag, data = recv((TAG_STOP, TAG_WORK))
        if tag == TAG_STOP:
            send(encode(Stop(token=decode_stop(data).token)), TAG_STOP_ACK)
            os._exit(0)
        token = decode_work(data).token
        answers = results(token)
        if answers is None:
            continue
        for message in answers:
            send(message, TAG_RESULT)
        send(ready(token), TAG_READY)


def flood(n: int) -> None:
    """Answers every WORK with `n` RESULTs that carry its (current) token and a status no
    worker sends, then the READY echoing it: each RESULT is an invalid payload of the
    current dispatch."""
    answering(lambda token: [encode(Result(token=token, status="bogus"))] * n)


def fake_pid(pid: int) -> None:
    """Reports this host's name and `pid`, a process that does not exist (a lie, or a rank in
    another pid namespace), then holds each WORK until its STOP comes."""
    answering(lambda token: None, first=ready(pid=pid))


def timeouts() -> None:
    """Answers every WORK at once with a valid `timeout` RESULT, then READY."""
    answering(lambda token: [encode(Result(token=token, status="timeout"))])


def splits() -> None:
    """Answers every WORK at once with a `split` RESULT (its outcomes too large for one
    message, it says), then READY: a batch goes back in halves, and a WORK of one task, which
    cannot be split, is an invalid payload."""
    answering(lambda token: [encode(Result(token=token, status="split",
                                           detail="its outcomes are too large"))])


def big_burst(n: int, size: int, bursts: int) -> None:
    """`bursts` times, `n` messages of `size` bytes posted at once (`Isend`), alternately
    stale RESULTs (a `status` of `size` characters) and malformed READYs (a `host` of as
    many); then honest. Each is under --max-message-bytes when `size` is, and the master
    holds what it receives of them while it works through its round."""
    send(ready(), TAG_READY)
    pad = "x" * size
    enc = msgspec.msgpack.Encoder()
    stale = enc.encode({"token": "0" * 64, "status": pad})
    bad = enc.encode({"rank": RANK, "completed_dispatch_token": "", "host": pad})
    del pad
    for _ in range(bursts):
        MPI.Request.Waitall([comm.Isend([stale if i % 2 else bad, MPI.BYTE], dest=0,
                                        tag=TAG_RESULT if i % 2 else TAG_READY)
                             for i in range(n)])
    honest(first_ready=False)


def answer(token: str) -> bytes:
    return encode(Result(token=token, status="ok", value={"n": 0}))


def empty_arrays(n: int) -> bytes:
    """A msgpack array of `n` empty arrays: ~1 byte each on the wire, a list each in Python."""
    return b"\xdd" + n.to_bytes(4, "big") + b"\x90" * n


def bomb_result(token: str, where: str, n: int) -> bytes:
    enc = msgspec.msgpack.Encoder()
    head = b"\x84" + enc.encode("token") + enc.encode(token) + enc.encode("status") + \
        enc.encode("ok")
    if where == "value":
        return head + enc.encode("value") + empty_arrays(n) + enc.encode("v") + enc.encode(1)
    tcs = b"\xdd" + n.to_bytes(4, "big") + b"\x92\xa0\xc4\x00" * n  # n of ["", b""]
    return head + enc.encode("testcases") + tcs + enc.encode("v") + enc.encode(1)


class Evil:
    """A pickle that, unpickled, creates the file named in ARG."""

    def __reduce__(self):
        return (open, (ARG, "w"))


def main() -> None:
    tag, data = recv((TAG_START, TAG_STOP))  # the verdict, as a worker waits for it
    if tag == TAG_STOP:
        os._exit(0)
    if MODE == "silent":  # never joins: no READY, ever
        while True:
            time.sleep(60)
    elif MODE == "pid":  # a pid the store cannot hold, then honest
        send(ready(pid=2**64 - 1), TAG_READY)
    elif MODE == "timeouts":  # every WORK answered at once: `timeout`
        timeouts()
    elif MODE == "split":  # every WORK answered at once: `split`
        splits()
    elif MODE == "fakepid":  # a pid no process has, each WORK held until the STOP
        fake_pid(int(ARG))
    elif MODE == "steer":  # another process's pid, then deaf to STOP
        send(ready(pid=int(ARG)), TAG_READY)
        while True:
            time.sleep(60)
    elif MODE == "oversized":  # ARG bytes on the RESULT tag, as one message
        size = int(ARG)
        unit = 1 << 20
        big = bytearray(size)
        if size >= 2**31:  # past what a count of bytes can say: in 1 MiB elements
            mb = MPI.BYTE.Create_contiguous(unit).Commit()
            comm.Send([big, size // unit, mb], dest=0, tag=TAG_RESULT)
        else:
            send(big, TAG_RESULT)
        del big
    elif MODE in ("bomb-value", "bomb-testcases", "testcases"):
        send(ready(), TAG_READY)
        _, data = recv((TAG_WORK,))
        token = decode_work(data).token
        if MODE == "testcases":
            n = int(ARG)
            send(encode(Result(token=token, status="ok", testcases=[
                (f"tc{i}", b"%d" % i) for i in range(n)])), TAG_RESULT)
        else:
            send(bomb_result(token, MODE.split("-")[1], int(ARG)), TAG_RESULT)
        send(ready(token), TAG_READY)
        honest(first_ready=False)
    elif MODE == "foreign":  # ARG small messages on a tag the master never receives
        for _ in range(int(ARG)):
            send(b"x" * 16, 99)
    elif MODE == "garbage":  # ARG undecodable RESULTs and READYs, then honest
        for i in range(int(ARG)):
            send(b"\xc1garbage", TAG_RESULT if i % 2 else TAG_READY)
    elif MODE == "flood":  # each WORK answered with ARG bad RESULTs of its token, then READY
        flood(int(ARG))
    elif MODE == "deaf":  # honest, but its STOP answered with garbage, never acknowledged
        honest(deaf=True)
    elif MODE == "acks":  # honest, but ARG forged STOP_ACKs before its own at the stop
        honest(forged_acks=int(ARG))
    elif MODE == "burst":  # ARG "N:SIZE:BURSTS": bursts of large stale RESULTs and READYs
        n, size, bursts = ARG.split(":")
        big_burst(int(n), int(size), int(bursts))
    elif MODE == "pickle":  # pickles to the other workers, on every tag they receive
        evil = pickle.dumps(Evil())
        for dest in range(2, comm.Get_size()):
            for tag in (TAG_START, TAG_WORK, TAG_STOP):
                send(evil, tag, dest)
    honest()


main()
