"""Which cores each rank's threads run on, and how many threads it runs: vLLM's
``VLLM_CPU_OMP_THREADS_BIND`` and ``VLLM_CPU_NUM_OF_RESERVED_CPU`` (declared in trillm/envs.py).

- one core list per rank (``0-31|32-63``): rank i's threads on the i-th list, one per core;
- ``auto``: the cores this process may use (``os.sched_getaffinity``; one logical CPU per
  physical core, as vLLM picks), less the reserved ones at the end (left to the API server and
  the engine core), split into equal runs of neighbouring cores, one per rank;
- ``nobind`` (also when both are unset): nothing pinned; ``OMP_NUM_THREADS`` threads, else an
  equal share of the cores.

"The ranks" are every engine core's ranks on this node (tensor x pipeline parallel ranks per
node, x data parallel engine cores). A rank pins every thread it has before its model's threads
start; torch's intra-op threads and the native kernels' pool (``ext/cpu_common.h``, sized by
torch's count, made on first use) are created after and inherit the pinning.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import attrs

from trillm import envs
from trillm.config import ParallelConfig

BIND = envs.CPU_OMP_THREADS_BIND.name
RESERVED = envs.CPU_NUM_OF_RESERVED_CPU.name


@attrs.frozen
class RankCores:
    """What one rank got: its cores (None: not pinned) and its torch / native threads."""

    cores: tuple[int, ...] | None
    threads: int


def node_ranks(parallel: ParallelConfig) -> int:
    """The ranks sharing this node's cores: every engine core's ranks here."""
    return parallel.ranks_per_node * parallel.data_parallel_size


def node_slot(parallel: ParallelConfig, rank: int) -> int:
    """This rank's place among ``node_ranks``: engine core d's local rank r is d * L + r."""
    local = parallel.ranks_per_node
    return parallel.data_parallel_rank * local + rank % local


def plan(parallel: ParallelConfig) -> list[tuple[int, ...]] | None:
    """Each of this node's ranks' cores (None: nobind), from the variables; a ValueError
    naming the variable where they cannot be honoured (called at load and in each rank)."""
    allowed = sorted(os.sched_getaffinity(0))
    return split_cores(
        envs.CPU_OMP_THREADS_BIND.get(),
        envs.CPU_NUM_OF_RESERVED_CPU.get(),
        node_ranks(parallel),
        allowed,
        one_per_physical_core,
    )


def split_cores(
    bind: envs.CpuBinding | None,
    reserved: int | None,
    ranks: int,
    allowed: Sequence[int],
    physical: Callable[[Sequence[int]], list[int]],
) -> list[tuple[int, ...]] | None:
    """``plan`` on given facts: ``allowed`` the usable core ids (sorted), ``physical`` the
    pick of one logical CPU per physical core."""
    if bind is None:
        bind = "nobind" if reserved is None else "auto"  # the reserved cores are auto's
    if reserved is not None and bind != "auto":
        raise ValueError(
            f"{RESERVED}={reserved} applies to {BIND}=auto only ({BIND} is "
            f"{describe(bind)}); unset one of them."
        )
    if bind == "nobind":
        return None
    if bind == "auto":
        return _auto(physical(allowed), ranks, reserved)
    return _lists(bind, ranks, allowed)


def _auto(cores: list[int], ranks: int, reserved: int | None) -> list[tuple[int, ...]]:
    if reserved is None:
        reserved = 1 if ranks > 1 else 0  # vLLM's default: one core left when ranks are several
    usable = cores[: len(cores) - reserved]
    if len(usable) < ranks:
        raise ValueError(
            f"{BIND}=auto: {len(cores)} usable cores less {reserved} reserved ({RESERVED}) "
            f"leave {len(usable)} for {ranks} ranks, and each rank needs one."
        )
    share, extra = divmod(len(usable), ranks)
    runs, start = [], 0
    for i in range(ranks):
        end = start + share + (1 if i < extra else 0)  # the first ranks take the remainder
        runs.append(tuple(usable[start:end]))
        start = end
    return runs


def _lists(
    lists: tuple[tuple[int, ...], ...], ranks: int, allowed: Sequence[int]
) -> list[tuple[int, ...]]:
    if len(lists) != ranks:
        raise ValueError(
            f"{BIND} gives {len(lists)} core lists ({describe(lists)}) but this node runs "
            f"{ranks} ranks: one list per rank, separated by '|'."
        )
    outside = sorted({core for cores in lists for core in cores} - set(allowed))
    if outside:
        raise ValueError(
            f"{BIND}: cores {_ranges(outside)} are not among this process's usable cores "
            f"({_ranges(allowed)})."
        )
    return list(lists)


def one_per_physical_core(allowed: Sequence[int]) -> list[int]:
    """The lowest-numbered allowed logical CPU of each physical core (hyperthreads share a
    core's units; vLLM's auto binding takes one per core too). Without sysfs: all of them."""
    seen, picked = set(), []
    for cpu in allowed:
        topology = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology")
        try:
            core = (
                (topology / "physical_package_id").read_text(),
                (topology / "core_id").read_text(),
            )
        except OSError:
            core = (str(cpu), "")
        if core not in seen:
            seen.add(core)
            picked.append(cpu)
    return picked


def bind_rank(parallel: ParallelConfig, rank: int) -> RankCores:
    """Pin every thread of this process to the rank's cores and give torch (and so the native
    kernels) one thread per core; nobind: an equal share. Where a variable asks for either, it
    says on stderr what the rank got."""
    cores = plan(parallel)
    got = _unbound(parallel) if cores is None else _pin(cores[node_slot(parallel, rank)])
    if cores is not None or envs.CPU_OMP_THREADS_BIND.get() is not None:
        line = f"rank {rank} (pid {os.getpid()}): {describe_rank(got)}\n"
        sys.stderr.write(line)  # one write: the ranks start at the same moment
        sys.stderr.flush()
    return got


def _pin(cores: tuple[int, ...]) -> RankCores:
    import torch

    for tid in os.listdir("/proc/self/task"):  # threads started before this one included
        try:
            os.sched_setaffinity(int(tid), cores)
        except ProcessLookupError:
            pass  # the thread ended meanwhile
    torch.set_num_threads(len(cores))
    return RankCores(cores, len(cores))


def _unbound(parallel: ParallelConfig) -> RankCores:
    import torch

    threads = _omp_num_threads()
    if threads is not None:  # nobind's count, as OpenMP reads it (torch's start capped 8 at 2 here)
        torch.set_num_threads(threads)
    elif node_ranks(parallel) > 1:
        # NOTE: ranks sharing the cores split them (more threads than cores thrash, and the
        # native kernels follow torch's count); a rank alone keeps torch's own default.
        torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // node_ranks(parallel)))
    return RankCores(None, torch.get_num_threads())


def _omp_num_threads() -> int | None:
    """OMP_NUM_THREADS' outermost level ("8" or "8,2"); None when unset or not a count."""
    first = os.environ.get("OMP_NUM_THREADS", "").split(",")[0].strip()
    return int(first) if first.isdigit() and int(first) > 0 else None


def describe_rank(got: RankCores) -> str:
    where = "not pinned" if got.cores is None else f"cores {_ranges(got.cores)}"
    return f"{where}; threads: {got.threads} (torch's and the native kernels')"


def summary() -> str:
    """What the variables give on this machine (``trillm collect-env``): each rank's cores for
    the lists given, or for 1 and 2 ranks under auto; a refusal as the start-up would say it."""
    try:
        bind, reserved = envs.CPU_OMP_THREADS_BIND.get(), envs.CPU_NUM_OF_RESERVED_CPU.get()
    except ValueError as exc:
        return f"refused: {exc}"
    counts = (len(bind),) if isinstance(bind, tuple) else (1, 2)
    parts = []
    allowed = sorted(os.sched_getaffinity(0))
    for ranks in counts:
        try:
            cores = split_cores(bind, reserved, ranks, allowed, one_per_physical_core)
        except ValueError as exc:
            parts.append(f"{_ranks(ranks)}: refused ({exc})")
            continue
        if cores is None:
            return "nobind: not pinned; each rank OMP_NUM_THREADS threads, else cores / ranks"
        parts.append(f"{_ranks(ranks)}: " + " | ".join(_ranges(c) for c in cores))
    mode = "auto" if bind is None or bind == "auto" else describe(bind)
    return f"{mode}: " + "; ".join(parts) + " (one thread per core)"


def _ranks(count: int) -> str:
    return "1 rank" if count == 1 else f"{count} ranks"


def describe(bind: envs.CpuBinding) -> str:
    """The variable's value as one writes it."""
    if isinstance(bind, str):
        return bind
    return "|".join(_ranges(cores) for cores in bind)


def _ranges(cores: Sequence[int]) -> str:
    """0,1,2,5 -> '0-2,5': runs of consecutive ids joined, in the order given."""
    runs: list[list[int]] = []
    for core in cores:
        if runs and core == runs[-1][-1] + 1:
            runs[-1].append(core)
        else:
            runs.append([core])
    return ",".join(str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}" for run in runs)
