"""A rank zygote that stays (``python -m trillm.executor.rank_server --socket ADDRESS``): it
imports torch and the worker's modules once, then forks the ranks of every engine start (one
rank or several) whose process names its socket in ``TRILLM_RANK_ZYGOTE``. A start otherwise pays a fresh
zygote's imports (~3.5 s of CPU on this project's 2-core machines) each time: this is for a
process that starts many engines one after another (a test session).

ADDRESS is a Unix socket path, or ``@name`` for a name in Linux's abstract namespace (no file).
Each start is one connection. The executor sends its ranks (rank_zygote's ``[worker argv, kept
fds]`` list), its environment, working directory and trillm folder, and, as SCM_RIGHTS, its
stdin, stdout and stderr and every fd the ranks keep. The server forks a one-start zygote,
which puts each fd at the number the command lines name, takes that environment, forks the
ranks as ``rank_zygote`` does, writes their pids on the connection and exits; the server then
writes ``exit CODE``. Its ranks go to the nearest child subreaper among the server's ancestors:
the executor's process, a subreaper during the start, so it must be one of them (the executor
checks that the server is its descendant).

Torch, OpenMP and the native extensions read some variables once, when loaded: a start whose
environment sets any of them otherwise than the server's did, or that runs another trillm
folder, is refused (``error REASON``), never run with the server's settings instead. Like the
zygote, the server starts no thread, so every fork is safe.
"""

from __future__ import annotations

import argparse
import array
import contextlib
import ctypes
import fcntl
import json
import os
import signal
import socket
import struct
import sys
import traceback
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from trillm.executor import rank_zygote

if TYPE_CHECKING:
    import trio

PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])  # the folder holding trillm/
# Variables read when torch, OpenMP, MKL or trillm's extensions are loaded (names or prefixes).
READ_AT_IMPORT = ("OMP_", "GOMP_", "KMP_", "MKL_", "TRILLM_NO_EXTENSIONS")
HEADER = struct.Struct("!Q")  # the request's length in bytes, then its JSON
MAX_FDS = 253  # SCM_RIGHTS' limit per message
PR_SET_PDEATHSIG = 1
MODULE = "trillm.executor.rank_server"
REQUEST_TIMEOUT_S = 30.0  # for a start's request to arrive, and for each answer to be taken
CMDLINE_ROOM = 4096  # bytes; a 4-rank start's longest worker command line is ~600

RankSpec = tuple[list[str], list[int]]  # (the worker's arguments, the fds it keeps)


def socket_address(address: str) -> str:
    """``@name`` -> the abstract name (a leading NUL); a path as it is."""
    return "\0" + address[1:] if address.startswith("@") else address


def read_at_import(env: Mapping[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k.startswith(READ_AT_IMPORT)}


# --- the executor's side (rank_launch.py sends and reads these) ----------------------------


def request_fds(specs: list[RankSpec]) -> list[int]:
    """The fds a start sends, in order: stdin, stdout, stderr, then every kept fd once."""
    return [0, 1, 2, *sorted({fd for _, kept in specs for fd in kept})]


def encode_request(specs: list[RankSpec], env: Mapping[str, str]) -> bytes:
    body = {
        "ranks": [[argv, kept] for argv, kept in specs],
        "env": dict(env),
        "cwd": os.getcwd(),
        "package": PACKAGE_ROOT,
    }
    data = json.dumps(body).encode()
    return HEADER.pack(len(data)) + data


def fds_message(fds: list[int]) -> list[tuple[int, int, bytes]]:
    return [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds).tobytes())]


def parse_report(report: bytes | bytearray) -> tuple[list[int], int | None, str | None]:
    """-> (the ranks' pids, the one-start zygote's exit code, the server's refusal)."""
    pids: list[int] = []
    code = error = None
    for line in report.decode(errors="replace").splitlines():
        if line.isdigit():
            pids.append(int(line))
        elif line.startswith("exit "):
            code = int(line.split()[1])
        elif line.startswith("error "):
            error = line[len("error ") :]
    return pids, code, error


def peer_pid(sock: socket.socket | trio.socket.SocketType) -> int:
    """The pid of the process at the other end of a connected Unix socket."""
    return _peer(sock)[0]


def _peer(sock: socket.socket | trio.socket.SocketType) -> tuple[int, int]:
    """(pid, uid) of the process at the other end of a connected Unix socket."""
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, _ = struct.unpack("3i", creds)
    return int(pid), int(uid)


def _parent(pid: int) -> int:
    with open(f"/proc/{pid}/stat", "rb") as f:
        return int(f.read().rsplit(b")", 1)[1].split()[1])


def is_descendant(pid: int, ancestor: int) -> bool:
    with contextlib.suppress(OSError, ValueError, IndexError):
        while pid > 1:
            pid = _parent(pid)
            if pid == ancestor:
                return True
    return False


# --- the server --------------------------------------------------------------------------


def _receive(conn: socket.socket) -> tuple[dict[str, Any], list[int]]:
    data, fds, _, _ = socket.recv_fds(conn, 1 << 16, MAX_FDS)
    try:
        while len(data) < HEADER.size or len(data) < HEADER.size + HEADER.unpack_from(data)[0]:
            chunk = conn.recv(1 << 16)
            if not chunk:
                raise ValueError("the connection closed mid-request")
            data += chunk
        return json.loads(data[HEADER.size :]), fds
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise


def _refusal(request: dict[str, Any], fd_count: int, import_env: Mapping[str, str]) -> str | None:
    if request["package"] != PACKAGE_ROOT:
        return f"it runs trillm from {PACKAGE_ROOT}, the engine from {request['package']}"
    theirs, ours = read_at_import(request["env"]), read_at_import(import_env)
    differ = sorted(k for k in theirs.keys() | ours.keys() if theirs.get(k) != ours.get(k))
    if differ:
        return (
            f"the engine's environment sets {', '.join(differ)} otherwise than the server's, "
            "which torch and the extensions read when the server imported them"
        )
    specs = [(list(a), list(f)) for a, f in request["ranks"]]
    if fd_count != len(request_fds(specs)):
        return f"{fd_count} fds arrived for the {len(request_fds(specs))} the ranks need"
    return None


def _place_fds(conn: socket.socket, received: list[int], targets: list[int]) -> int:
    """Each received fd at its target number (the ranks' command lines name them); -> the
    connection's fd, above them all."""
    floor = max(targets) + 1
    report = fcntl.fcntl(conn.fileno(), fcntl.F_DUPFD, floor)
    conn.close()
    moved = [fcntl.fcntl(fd, fcntl.F_DUPFD, floor) for fd in received]
    for fd in received:
        os.close(fd)
    for source, target in zip(moved, targets, strict=True):
        os.dup2(source, target)
        os.close(source)
    return report


def _one_start(
    conn: socket.socket, listener: socket.socket, fds: list[int], request: dict[str, Any]
) -> NoReturn:
    """In the forked one-start zygote: fork the request's ranks, then exit."""
    code = 1
    try:
        listener.close()
        specs = [(list(a), list(f)) for a, f in request["ranks"]]
        report = _place_fds(conn, fds, request_fds(specs))
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        rank_zygote.ignore_signals()
        code = rank_zygote.fork_ranks(specs, report)
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _answer(conn: socket.socket, listener: socket.socket, import_env: Mapping[str, str]) -> None:
    try:
        request, fds = _receive(conn)
    except (OSError, ValueError):  # a client gone (or a probe): the next one may be fine
        return
    try:
        refusal = _refusal(request, len(fds), import_env)
        if refusal is not None:
            conn.sendall(f"error {refusal}\n".encode())
            return
        pid = os.fork()
        if pid == 0:
            _one_start(conn, listener, fds, request)
    finally:
        for fd in fds:
            os.close(fd)
    code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    with contextlib.suppress(OSError):  # the executor gave up: its ranks are its to end
        conn.sendall(f"exit {code}\n".encode())


def serve(listener: socket.socket, import_env: Mapping[str, str]) -> NoReturn:
    """Answer starts one at a time, for ever (each takes milliseconds: its zygote only forks).
    ``import_env``: the environment the server imported torch under."""
    while True:
        conn, _ = listener.accept()
        with conn:
            # An abstract name has no file permissions: only this user's processes may have
            # ranks forked (a start runs the command lines it sends).
            if _peer(conn)[1] != os.getuid():
                continue
            conn.settimeout(REQUEST_TIMEOUT_S)  # a client that sends nothing holds no one up
            _answer(conn, listener, import_env)


def listen(address: str) -> socket.socket:
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(socket_address(address))
    listener.listen(8)
    return listener


def fork_server(address: str, import_env: Mapping[str, str]) -> int:
    """A server on ``address`` forked from this process, which must have no thread running
    (and room in its command line for a rank's: see ``main``); it dies with this process.
    ``import_env``: the environment torch was imported under here. Returns once it listens
    (or has failed to) -> its pid: a child of this process, so a start from here may use it."""
    ready_r, ready_w = os.pipe()
    parent = os.getpid()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(ready_r)
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
            if os.getppid() == parent:  # else it died before the line above
                # Bound here, not before the fork: a client learns the pid of the process
                # that listens (SO_PEERCRED), and must learn this one's.
                listener = listen(address)
                os.close(ready_w)
                rank_zygote.preload()
                serve(listener, import_env)
        except BaseException:
            traceback.print_exc()
        finally:
            os._exit(1)
    os.close(ready_w)
    os.read(ready_r, 1)  # end of file once it listens, or has died
    os.close(ready_r)
    return pid


@contextlib.contextmanager
def _socket_file(address: str) -> Iterator[None]:
    """The socket file removed at exit (an abstract name has none)."""
    try:
        yield
    finally:
        if not address.startswith("@"):
            with contextlib.suppress(OSError):
                os.unlink(address)


def _raise_exit(signum: int, frame: object) -> None:
    raise SystemExit(0)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="trillm rank zygote server (see TRILLM_RANK_ZYGOTE)")
    p.add_argument("--socket", required=True, help="a Unix socket path, or @name (abstract)")
    p.add_argument("--room", help="blank: room in this command line for the ranks' own")
    p.add_argument("--parent", type=int, help="a pid: the server ends (SIGTERM) when it does")
    args = p.parse_args(argv)
    if args.parent is not None:
        # Kept across the exec below; checked after it is set: the parent may be gone already.
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
        if os.getppid() != args.parent:
            return 0
    if args.room is None:
        # Each rank rewrites its inherited command line in place (rank_zygote.set_cmdline), so
        # that ps shows it as the worker it is: this one must be longer than any rank's.
        room = " " * CMDLINE_ROOM
        os.execv(
            sys.executable,
            [sys.executable, "-m", MODULE, "--socket", args.socket, "--room", room]
            + ([] if args.parent is None else ["--parent", str(args.parent)]),
        )
    signal.signal(signal.SIGTERM, _raise_exit)
    listener = listen(args.socket)  # before the imports: a start may connect and wait
    with _socket_file(args.socket), listener:
        rank_zygote.preload()
        serve(listener, dict(os.environ))


if __name__ == "__main__":
    sys.exit(main())
