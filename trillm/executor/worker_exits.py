"""The message that names a worker's exit, for ``MultiprocExecutor``'s supervisors.

``WorkerExits`` keeps what the workers said before they exited (their ``WorkerFailed``, read
from their result rings) and writes the message an unexpected exit fails the executor with:
the rank, its pid and how it ended (``describe_exit``), and its last words. A rank whose
collective timed out (``WorkerFailed.collective``) is the start of a wait for the others'
reports: the ranks that sent none are named as the ones that stopped answering.
"""

from __future__ import annotations

import signal

import trio

from trillm.config import ParallelConfig
from trillm.executor.worker_ipc import WorkerIpc
from trillm.ipc.control import WorkerFailed

# After a rank reports a timed-out collective, how long the others get to report theirs:
# the ranks that have not by then are the ones that stopped answering.
COLLECTIVE_REPORT_GRACE_S = 2.0


def describe_exit(returncode: int) -> str:
    """``-9`` -> "killed by signal SIGKILL"; ``1`` -> "exited with code 1"."""
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = str(-returncode)
        return f"killed by signal {name}"
    return f"exited with code {returncode}"


class WorkerExits:
    """The workers' last words and the messages that name their exits; one per executor."""

    def __init__(self, parallel: ParallelConfig, num_workers: int) -> None:
        self.parallel = parallel
        self.num_workers = num_workers  # the worker processes on this node
        self.remote_ranks = parallel.remote_ranks()
        self._reported: dict[int, WorkerFailed] = {}  # rank -> its last words
        self._collective_reports: set[int] = set()  # ranks whose collective timed out

    def report(self, words: WorkerFailed) -> None:
        """Last words read where a step's output was due (its rank's supervisor uses them)."""
        self._reported[words.rank] = words

    async def message(self, ipc: WorkerIpc, rank: int, pid: int, code: int) -> str | None:
        """What rank ``rank``'s exit fails the executor with; None where another rank's timed
        out collective is already being reported (that rank names the silent ones)."""
        engine = self.parallel.data_parallel_rank
        where = f" of engine core {engine}" if self.parallel.data_parallel_size > 1 else ""
        message = f"Worker rank {rank}{where} (pid {pid}) {describe_exit(code)}."
        last_words = self._reported.pop(rank, None) or ipc.last_words(rank)
        if last_words is not None:
            message += "\n" + last_words.message
        if last_words is not None and last_words.collective:
            self._collective_reports.add(rank)
            if len(self._collective_reports) > 1:
                return None  # the first rank that reported names the silent ones
            message = await self._name_silent_ranks(ipc) + "\n" + message
        return message

    async def _name_silent_ranks(self, ipc: WorkerIpc) -> str:
        """A collective timed out on some rank: wait a little for the other ranks' reports;
        -> which ranks stopped answering (no report) and which waited for them."""
        with trio.move_on_after(COLLECTIVE_REPORT_GRACE_S):
            while len(self._collective_reports) < self.num_workers:
                for rank in range(self.num_workers):
                    if rank in self._collective_reports:
                        continue
                    words = self._reported.get(rank) or ipc.last_words(rank)
                    if words is not None and words.collective:
                        self._reported[rank] = words  # its supervisor reads it
                        self._collective_reports.add(rank)
                await trio.sleep(0.05)
        waited = sorted(self._collective_reports)
        silent = [r for r in range(self.parallel.world_size) if r not in self._collective_reports]
        timeout = self.parallel.collective_timeout_s
        remote = [r for r in silent if r in self.remote_ranks]
        where = ""
        if remote:  # they cannot report here once the link is down: their node's log says
            where = f" (rank(s) {remote} run on other nodes: see their node's log)"
        return (
            f"A tensor-parallel collective timed out: rank(s) {silent} stopped answering"
            f"{where}; rank(s) {waited} waited {timeout:g} s for them."
        )
