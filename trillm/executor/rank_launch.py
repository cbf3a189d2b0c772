"""How ``MultiprocExecutor`` starts its ranks: each as a process of its own, or several forked
from one rank zygote (``rank_zygote.py``) that imports torch and the worker's modules once.

Either way every rank ends as a child of this process with the command line ``python -m
trillm.worker.worker_main --rank R ...`` and the fds ``WorkerIpc.worker_args`` names. The
zygote's children are adopted: this process is a child subreaper (``PR_SET_CHILD_SUBREAPER``)
from the zygote's start until it has exited, so the ranks it forked and left come to this
process rather than to init; each is then waited on and signalled through a pidfd
(``AdoptedRank``, the same interface the executor uses on ``trio.Process``). A zygote start
saves a 4-rank start ~11 s of CPU on 2 cores (benchmarks/archive/RESULTS-journal.md, section 36).

``TRILLM_WORKER_START``: ``zygote`` (the default: several ranks from one zygote, one rank as a
process of its own) or ``spawn`` (every rank its own process, as before the zygote); Linux
without pidfds (before 5.3) always spawns.
``TRILLM_RANK_ZYGOTE``: the socket of a zygote that stays (``rank_server.py``), started by this
process, to fork the ranks of every start from (a one-rank start's too), instead of a fresh
zygote each.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import socket
import sys
import threading
from collections.abc import Iterator
from typing import Protocol

import trio

from trillm import envs
from trillm.errors import EngineStartupError
from trillm.executor import rank_server
from trillm.executor.rank_zygote import WORKER_MODULE
from trillm.executor.worker_exits import describe_exit
from trillm.executor.worker_ipc import worker_env

ZYGOTE_MODULE = "trillm.executor.rank_zygote"
START_ENV = envs.WORKER_START.name
START_MODES = ("zygote", "spawn")
PR_SET_CHILD_SUBREAPER, PR_GET_CHILD_SUBREAPER = 36, 37
CLEANUP_GRACE_S = 5.0

RankSpec = tuple[list[str], list[int]]  # (the worker's arguments, the fds it inherits)


class RankProcess(Protocol):
    """What the executor needs of a rank's process (``trio.Process`` has it)."""

    @property
    def pid(self) -> int: ...

    @property
    def returncode(self) -> int | None: ...

    async def wait(self) -> int: ...

    def kill(self) -> None: ...


class AdoptedRank:
    """A rank forked by the zygote and adopted by this process (its child, so its exit status
    is this process's to read), waited on and signalled through a pidfd: no pid reuse race."""

    def __init__(self, pid: int) -> None:
        self._pid = pid
        self._pidfd = os.pidfd_open(pid)
        self._returncode: int | None = None
        self._wait_lock = trio.Lock()

    @property
    def pid(self) -> int:
        return self._pid

    @property
    def returncode(self) -> int | None:
        return self._returncode

    def _reap(self, flags: int = 0) -> int | None:
        result = os.waitid(os.P_PIDFD, self._pidfd, os.WEXITED | flags)
        if result is None:  # WNOHANG, still running
            return None
        exited = result.si_code == os.CLD_EXITED
        self._returncode = result.si_status if exited else -result.si_status
        os.close(self._pidfd)
        self._pidfd = -1
        return self._returncode

    async def wait(self) -> int:
        async with self._wait_lock:  # one task at a time on the pidfd
            if self._returncode is None:
                await trio.lowlevel.wait_readable(self._pidfd)
                self._reap()
        assert self._returncode is not None
        return self._returncode

    def kill(self) -> None:
        if self._returncode is None:
            with contextlib.suppress(ProcessLookupError):
                signal.pidfd_send_signal(self._pidfd, signal.SIGKILL)


def start_mode() -> str:
    return envs.WORKER_START.get()


_prctl_lock = threading.Lock()
_subreaper_users = 0
_subreaper_ours = False  # set by us (not before us), so ours to clear


def _prctl(option: int, arg: int | ctypes._Pointer[ctypes.c_int]) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(option, arg, 0, 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"prctl({option}): {os.strerror(err)}")


def pidfds_supported() -> bool:
    if not sys.platform.startswith("linux") or not hasattr(os, "pidfd_open"):
        return False
    try:
        os.close(os.pidfd_open(os.getpid()))
    except OSError:
        return False
    return True


@contextlib.contextmanager
def child_subreaper() -> Iterator[None]:
    """This process is a child subreaper inside (counted: engines may start side by side)."""
    global _subreaper_users, _subreaper_ours
    with _prctl_lock:
        if _subreaper_users == 0:
            current = ctypes.c_int(0)
            _prctl(PR_GET_CHILD_SUBREAPER, ctypes.pointer(current))
            _subreaper_ours = current.value == 0
            if _subreaper_ours:
                _prctl(PR_SET_CHILD_SUBREAPER, 1)
        _subreaper_users += 1
    try:
        yield
    finally:
        with _prctl_lock:
            _subreaper_users -= 1
            if _subreaper_users == 0 and _subreaper_ours:
                _prctl(PR_SET_CHILD_SUBREAPER, 0)


async def start_ranks(specs: list[RankSpec]) -> list[RankProcess]:
    """One process per spec, in rank order; on failure none is left running."""
    mode = start_mode()  # refused at every start, whatever the number of ranks
    server = envs.RANK_ZYGOTE.get()
    if server is not None and mode == "spawn":
        raise ValueError(
            f"{envs.RANK_ZYGOTE.name} names a rank zygote server, but {START_ENV}=spawn asks "
            "for every rank to be a process of its own: unset one of them."
        )
    if mode == "zygote" and pidfds_supported():
        # A server that stays forks any start's ranks, one included (it has imported the
        # worker already); a fresh zygote only pays off for several (it costs a spawn).
        if server is not None:
            return await _fork_from_server(server, specs)
        if len(specs) > 1:
            return list(await _fork_from_zygote(specs))
    procs: list[RankProcess] = []
    try:
        for argv, fds in specs:
            argv = [sys.executable, "-m", WORKER_MODULE, *argv]
            procs.append(await trio.lowlevel.open_process(argv, pass_fds=fds, env=worker_env()))
    except BaseException:
        with trio.CancelScope(shield=True):
            await _kill_all(procs)
        raise
    return procs


async def _kill_all(procs: list[RankProcess]) -> None:
    for proc in procs:  # every one signalled before any is waited for
        proc.kill()
    with trio.move_on_after(CLEANUP_GRACE_S):
        for proc in procs:
            await proc.wait()


async def _read_to_eof(stream: trio.lowlevel.FdStream, into: bytearray) -> None:
    while chunk := await stream.receive_some():
        into += chunk


async def _fork_from_zygote(specs: list[RankSpec]) -> list[AdoptedRank]:
    report_r, report_w = os.pipe()
    fds = sorted({fd for _, kept in specs for fd in kept})
    argv = [
        sys.executable,
        "-m",
        ZYGOTE_MODULE,
        "--report-fd",
        str(report_w),
        "--ranks",
        json.dumps([[a, f] for a, f in specs]),
    ]
    report = bytearray()
    with child_subreaper():
        try:
            zygote = await trio.lowlevel.open_process(
                argv, pass_fds=[*fds, report_w], env=worker_env()
            )
        except BaseException:
            os.close(report_r)
            raise
        finally:
            os.close(report_w)
        async with trio.lowlevel.FdStream(report_r) as stream:
            try:
                await _read_to_eof(stream, report)
                code = await zygote.wait()
            except BaseException:
                # Its forks so far come to this process once it is gone: reap them too.
                with trio.CancelScope(shield=True), trio.move_on_after(CLEANUP_GRACE_S):
                    zygote.kill()
                    await _read_to_eof(stream, report)
                    await zygote.wait()
                    await _kill_all([AdoptedRank(int(p)) for p in report.split()])
                raise
    ranks = [AdoptedRank(int(p)) for p in report.split()]
    if code != 0 or len(ranks) != len(specs):
        with trio.CancelScope(shield=True):
            await _kill_all(list(ranks))
        raise EngineStartupError(
            f"The rank zygote (pid {zygote.pid}) {describe_exit(code)} after starting "
            f"{len(ranks)} of {len(specs)} ranks (its error is in the log above)."
        )
    return ranks


async def _connect_server(address: str) -> trio.socket.SocketType:
    """A connection to the rank zygote server at ``address``, which must be this process's
    descendant: the ranks it forks can only become this process's children then."""
    sock = trio.socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        await sock.connect(rank_server.socket_address(address))
        server = rank_server.peer_pid(sock)
    except OSError as exc:
        sock.close()
        raise EngineStartupError(
            f"{envs.RANK_ZYGOTE.name}={address}: no rank zygote server answers there ({exc})."
        ) from None
    if not rank_server.is_descendant(server, os.getpid()):
        sock.close()
        raise EngineStartupError(
            f"{envs.RANK_ZYGOTE.name}={address}: its rank zygote server (pid {server}) was not "
            "started by this process, so the ranks it forks could not become this process's "
            "children; start the server from this process, or unset the variable."
        )
    return sock


async def _send_request(sock: trio.socket.SocketType, specs: list[RankSpec]) -> None:
    data = rank_server.encode_request(specs, worker_env())
    fds = rank_server.request_fds(specs)
    sent = await sock.sendmsg([data], rank_server.fds_message(fds))
    while sent < len(data):
        sent += await sock.send(data[sent:])


async def _receive_to_eof(sock: trio.socket.SocketType, into: bytearray) -> None:
    while chunk := await sock.recv(4096):
        into += chunk


async def _fork_from_server(address: str, specs: list[RankSpec]) -> list[RankProcess]:
    report = bytearray()
    with child_subreaper():
        sock = await _connect_server(address)
        with sock:
            try:
                await _send_request(sock, specs)
                await _receive_to_eof(sock, report)
            except BaseException:
                # The server answers once its one-start zygote has exited: every rank it
                # forked is then this process's child, to end here.
                with trio.CancelScope(shield=True), trio.move_on_after(CLEANUP_GRACE_S):
                    await _receive_to_eof(sock, report)
                    pids = rank_server.parse_report(report)[0]
                    await _kill_all([AdoptedRank(p) for p in pids])
                raise
    pids, code, refusal = rank_server.parse_report(report)
    ranks: list[RankProcess] = [AdoptedRank(p) for p in pids]
    if refusal is None and code == 0 and len(ranks) == len(specs):
        return ranks
    with trio.CancelScope(shield=True):
        await _kill_all(ranks)
    if refusal is not None:
        raise EngineStartupError(
            f"The rank zygote server at {envs.RANK_ZYGOTE.name}={address} refused the start: "
            f"{refusal}."
        )
    ended = "closed the connection" if code is None else describe_exit(code)
    raise EngineStartupError(
        f"The rank zygote server at {envs.RANK_ZYGOTE.name}={address}: its start {ended} "
        f"after starting {len(ranks)} of {len(specs)} ranks (its error is in the log above)."
    )
