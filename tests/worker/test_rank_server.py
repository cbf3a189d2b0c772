"""Ranks forked from a rank zygote server that stays (``TRILLM_RANK_ZYGOTE``,
trillm/executor/rank_server.py): they end as children of the engine's process with the
worker's own command line, one server serves start after start, and every start it cannot
serve as asked (a server this process did not start, an environment torch was imported under
otherwise, no server there, ``TRILLM_WORKER_START=spawn`` beside it) is refused naming why.
The fake runner keeps each start quick; real models forked this way run in tests/parallel.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys

import pytest
import trio
from worker_processes import pid_alive

from trillm.errors import EngineStartupError
from trillm.executor import rank_server
from trillm.executor.abstract import FAKE_RUNNER
from trillm.executor.factory import open_executor
from trillm.executor.worker_ipc import worker_env
from trillm.worker.fake_runner import make_fake_config

SERVER_START_S = 60


def _children() -> set[int]:
    found = set()
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/children") as f:
                found |= {int(pid) for pid in f.read().split()}
        except OSError:  # a thread that ended meanwhile
            continue
    return found


def _cmdline(pid: int) -> list[bytes]:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return f.read().split(b"\0")


def _reaped_children_faults(pid: int) -> int:
    """``pid``'s cminflt: page faults of the children it has reaped (its one-start zygotes)."""
    with open(f"/proc/{pid}/stat", "rb") as f:
        return int(f.read().rsplit(b")", 1)[1].split()[8])


def _wait_listening(address: str, proc: subprocess.Popen[bytes] | None = None) -> int:
    """-> the pid of the server listening at ``address``, once it does."""

    async def connect() -> int:
        while True:
            if proc is not None and proc.poll() is not None:
                raise RuntimeError(f"the rank zygote server exited {proc.returncode}")
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
                try:
                    probe.connect(rank_server.socket_address(address))
                    return rank_server.peer_pid(probe)
                except OSError:
                    await trio.sleep(0.02)

    async def main() -> int:
        with trio.fail_after(SERVER_START_S):
            return await connect()

    return trio.run(main)


@pytest.fixture(scope="module")
def server():
    """A server started by this process: ``(address, pid)``."""
    address = f"@trillm-test-rank-server-{os.getpid()}"
    argv = [sys.executable, "-m", rank_server.MODULE, "--socket", address]
    proc = subprocess.Popen(argv, env=worker_env())
    try:
        yield address, _wait_listening(address, proc)
    finally:
        proc.terminate()
        assert proc.wait() == 0  # SIGTERM ends it cleanly


def _start_tp2(tp: int = 2) -> list[list[bytes]]:
    """A TP=``tp`` fake executor started and stopped; -> its ranks' command lines while they
    ran, after checking that they were this process's children and exited cleanly."""

    async def main():
        with trio.fail_after(120):
            async with open_executor(make_fake_config(tensor_parallel_size=tp), FAKE_RUNNER) as ex:
                procs = list(ex.processes)
                assert {p.pid for p in procs} <= _children()
                argvs = [_cmdline(p.pid) for p in procs]
        return procs, argvs

    procs, argvs = trio.run(main)
    assert [p.returncode for p in procs] == [0] * tp
    assert not any(pid_alive(p.pid) for p in procs)
    return argvs


def test_ranks_forked_by_the_server_are_this_process_children(server, monkeypatch):
    address, pid = server
    monkeypatch.setenv("TRILLM_RANK_ZYGOTE", address)
    assert _reaped_children_faults(pid) == 0
    for start in (1, 2):  # the server stays for the next start
        argvs = _start_tp2()
        faults = _reaped_children_faults(pid)
        assert faults > 0, f"start {start}: the server forked nothing"
        for rank, argv in enumerate(sorted(argvs, key=lambda a: a[a.index(b"--rank") + 1])):
            head = [a.decode() for a in argv[:5]]
            assert head == [sys.executable, "-m", "trillm.worker.worker_main", "--rank", str(rank)]
            assert argv[argv.index(b"--parent-pid") + 1] == str(os.getpid()).encode()
    assert pid_alive(pid)


def test_a_one_rank_start_is_forked_by_the_server_too(server, monkeypatch):
    """The server has imported the worker: a one-rank engine forks its rank from it rather
    than spawning a process that imports torch again."""
    address, pid = server
    monkeypatch.setenv("TRILLM_RANK_ZYGOTE", address)
    before = _reaped_children_faults(pid)
    (argv,) = _start_tp2(tp=1)
    assert _reaped_children_faults(pid) > before, "the server forked nothing"
    head = [a.decode() for a in argv[:5]]
    assert head == [sys.executable, "-m", "trillm.worker.worker_main", "--rank", "0"]
    assert argv[argv.index(b"--parent-pid") + 1] == str(os.getpid()).encode()


def _refused(match: str) -> None:
    before = _children()
    with pytest.raises(EngineStartupError, match=match):
        _start_tp2()
    assert _children() <= before


def test_a_different_openmp_setting_is_refused_and_the_server_serves_on(server, monkeypatch):
    address, pid = server
    monkeypatch.setenv("TRILLM_RANK_ZYGOTE", address)
    monkeypatch.setenv("OMP_NUM_THREADS", "7")
    _refused(
        rf"rank zygote server at TRILLM_RANK_ZYGOTE={address} refused the start: the "
        r"engine's environment sets OMP_NUM_THREADS otherwise than the server's"
    )
    monkeypatch.undo()
    monkeypatch.setenv("TRILLM_RANK_ZYGOTE", address)
    _start_tp2()


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to connect as another user")
def test_another_users_connection_is_closed_unanswered_and_the_server_serves_on(
    server, monkeypatch
):
    address, _ = server
    pid = os.fork()
    if pid == 0:  # as nobody: connect, send a start, read what comes back
        code = 1
        try:
            os.setgid(65534)
            os.setuid(65534)
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
                conn.settimeout(30)
                conn.connect(rank_server.socket_address(address))
                try:
                    conn.sendall(rank_server.HEADER.pack(2) + b"{}")
                    code = 0 if conn.recv(64) == b"" else 2  # closed without a word
                except ConnectionError:  # closed before the request was sent or read
                    code = 0
        finally:
            os._exit(code)
    assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0
    monkeypatch.setenv("TRILLM_RANK_ZYGOTE", address)
    _start_tp2()


def test_a_server_this_process_did_not_start_is_refused(monkeypatch):
    address = f"@trillm-test-orphan-rank-server-{os.getpid()}"
    # Started by a shell that exits at once: the server is then nobody's here.
    launcher = f"{sys.executable} -m {rank_server.MODULE} --socket {address} &"
    subprocess.run(["sh", "-c", launcher], env=worker_env(), check=True)
    pid = _wait_listening(address)
    try:
        monkeypatch.setenv("TRILLM_RANK_ZYGOTE", address)
        _refused(
            rf"TRILLM_RANK_ZYGOTE={address}: its rank zygote server \(pid {pid}\) was not "
            r"started by this process"
        )
    finally:
        os.kill(pid, signal.SIGTERM)


def test_an_address_where_no_server_listens_is_refused(monkeypatch):
    monkeypatch.setenv("TRILLM_RANK_ZYGOTE", "@trillm-test-nobody-listens")
    _refused(r"TRILLM_RANK_ZYGOTE=@trillm-test-nobody-listens: no rank zygote server answers")


def test_a_server_beside_the_spawn_start_mode_is_refused(monkeypatch):
    monkeypatch.setenv("TRILLM_RANK_ZYGOTE", "@trillm-test-nobody-listens")
    monkeypatch.setenv("TRILLM_WORKER_START", "spawn")
    with pytest.raises(ValueError, match="TRILLM_RANK_ZYGOTE names .* TRILLM_WORKER_START=spawn"):
        _start_tp2()


def test_a_server_given_its_parent_ends_when_the_parent_is_killed():
    """``--parent PID``: a test worker killed outright (no atexit) leaves no server behind."""
    address = f"@trillm-test-parent-rank-server-{os.getpid()}"
    launch = (
        "import os, subprocess, sys, time\n"
        f"argv = [sys.executable, '-m', {rank_server.MODULE!r}, '--socket', {address!r}]\n"
        "p = subprocess.Popen(argv + ['--parent', str(os.getpid())])\n"
        "print(p.pid, flush=True)\n"
        "time.sleep(600)\n"
    )
    launcher = subprocess.Popen(
        [sys.executable, "-c", launch], env=worker_env(), stdout=subprocess.PIPE
    )
    assert launcher.stdout is not None
    pid = int(launcher.stdout.readline())
    try:
        assert _wait_listening(address) == pid
        launcher.kill()
        launcher.wait()

        async def gone() -> None:
            with trio.fail_after(30):
                while pid_alive(pid):
                    await trio.sleep(0.05)

        trio.run(gone)
    finally:
        launcher.kill()
        launcher.wait()
        launcher.stdout.close()
        if pid_alive(pid):
            os.kill(pid, signal.SIGKILL)
