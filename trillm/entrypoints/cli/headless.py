"""``trillm serve --headless --nnodes N --node-rank K ...``: node K's worker ranks, nothing else.

Node 0 runs the HTTP server, the engine core and ranks [0, L); node K runs ranks
[K * L, (K + 1) * L) (L = tensor x pipeline ranks / nnodes) as worker subprocesses of this
process, which join the torch.distributed world at ``--master-addr:--master-port`` and hear
the executor through rank 0 (``trillm/distributed/node_link.py``).

This process only supervises them: a worker that exits with an error (node 0 gone, a
collective timed out, a mismatched flag) takes the others down and this process exits 1;
Shutdown from node 0 ends them with 0, and so does this process. SIGTERM / SIGINT kill them.
Workers exit by themselves when this process dies (the parent-death pipe, as on node 0).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from trillm.config import EngineArgs

logger = logging.getLogger("trillm.headless")

POLL_S = 0.2
EXIT_GRACE_S = 10.0  # after one rank's clean exit, how long the others get to follow


def node_ranks(nnodes: int, node_rank: int, world_size: int) -> range:
    per_node = world_size // nnodes
    return range(node_rank * per_node, (node_rank + 1) * per_node)


def run_headless(model: str | None, engine_kwargs: dict[str, Any]) -> int:
    from trillm.config import EngineArgs
    from trillm.config.batch_defaults import UsageContext
    from trillm.engine.config_builder import build_config
    from trillm.executor.worker_exits import describe_exit

    args = EngineArgs(model=model, **engine_kwargs)
    if args.nnodes < 2 or args.node_rank == 0:
        raise ValueError(
            "--headless runs a node other than node 0: give --nnodes >= 2 and --node-rank >= 1."
        )
    # Refuse bad flags or a missing model before any worker starts (the server's defaults).
    build_config(args, UsageContext.OPENAI_API_SERVER)
    world = args.tensor_parallel_size * args.pipeline_parallel_size
    ranks = node_ranks(args.nnodes, args.node_rank, world)
    death_r, death_w = os.pipe()
    procs: dict[int, subprocess.Popen[bytes]] = {}
    stop = _install_signal_handlers()
    try:
        try:
            _start_ranks(args, ranks, death_r, procs)
        finally:
            os.close(death_r)  # the ranks hold their copies; a failed start must not leak ours
        logger.info(
            "node %d of %d: ranks %s started (pids %s); rendezvous at %s:%s",
            args.node_rank,
            args.nnodes,
            list(ranks),
            [p.pid for p in procs.values()],
            args.master_addr,
            args.master_port or "29500",
        )
        while not stop:
            for rank, proc in procs.items():
                code = proc.poll()
                if code is None:
                    continue
                if code == 0:
                    logger.info("rank %d: shut down by node 0.", rank)
                    return _await_rest(procs)
                logger.error("rank %d (pid %d) %s.", rank, proc.pid, describe_exit(code))
                return 1
            time.sleep(POLL_S)
        logger.info("signal %s: stopping this node's ranks.", stop[0])
        return 0
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
            proc.wait()
        os.close(death_w)


def _start_ranks(
    args: EngineArgs, ranks: range, death_r: int, procs: dict[int, subprocess.Popen[bytes]]
) -> None:
    """One ``worker_main`` process per rank of this node, each holding the parent-death pipe."""
    from trillm.executor.worker_ipc import worker_env

    for rank in ranks:
        argv = [
            sys.executable,
            "-m",
            "trillm.worker.worker_main",
            "--rank",
            str(rank),
            "--engine-args",
            json.dumps(asdict(args)),
            "--death-fd",
            str(death_r),
            "--parent-pid",
            str(os.getpid()),
        ]
        procs[rank] = subprocess.Popen(argv, pass_fds=[death_r], env=worker_env())


def _await_rest(procs: dict[int, subprocess.Popen[bytes]]) -> int:
    deadline = time.monotonic() + EXIT_GRACE_S
    codes = []
    for proc in procs.values():
        try:
            codes.append(proc.wait(max(0.0, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            codes.append(1)
    return 0 if not any(codes) else 1


def _install_signal_handlers() -> list[int]:
    """-> a list that gets the signal number when SIGTERM or SIGINT arrives."""
    got: list[int] = []

    def handle(signum: int, frame: Any) -> None:
        got.append(signum)

    signal.signal(signal.SIGTERM, handle)
    signal.signal(signal.SIGINT, handle)
    return got


# ---------------------------------------------------------------- the node flags
def add_node_flags(p: argparse.ArgumentParser) -> None:
    """--headless; the node flags themselves (--nnodes, --node-rank, --master-addr, ...) are
    EngineArgs fields, added with the other engine flags."""
    p.add_argument(
        "--headless",
        action="store_true",
        help="Run only this node's worker ranks (no HTTP server, no engine): a node other "
        "than node 0, started with the same engine flags and its --node-rank.",
    )


def check_node_flags(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """--node-rank > 0 runs headless; --headless runs a node other than node 0."""
    if args.headless and not args.node_rank:
        parser.error(
            "argument --headless: runs the worker ranks of a node other than node 0; "
            "give its --node-rank (>= 1) and --nnodes."
        )
    if args.node_rank and not args.headless:
        parser.error(
            f"argument --node-rank: node {args.node_rank} runs only worker ranks; "
            "start it with --headless (node 0 serves HTTP)."
        )
