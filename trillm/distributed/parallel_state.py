"""The tensor-parallel group of this process: one per worker, set once before the model is built.

A worker of a ``tensor_parallel_size`` N engine calls ``init_tensor_parallel`` (TCP rendezvous on
loopback at the port the executor picked; gloo on CPU, NCCL on GPU) before it builds the model;
the model's layers read ``get_tp_group()`` when they are constructed (their shard sizes) and
call its collectives in the forward. Without a call the group is the trivial one (rank 0 of 1),
whose collectives return their input, so TP=1 runs no ``torch.distributed`` code at all.

A collective that does not complete within ``timeout_s`` (a rank died or hangs) raises
``CollectiveTimeoutError``; the worker treats it as fatal (the group cannot be used again).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from functools import partial
from typing import Any

import torch
import torch.distributed as dist

from trillm.errors import CollectiveTimeoutError


@dataclass
class TensorParallelGroup:
    rank: int = 0
    world_size: int = 1
    timeout_s: float = 0.0
    # Ranks on several nodes: the gloo group of rank 0 and the other nodes' ranks, which
    # carries the executor's messages to them (``node_link.py``); None on one node.
    control: Any = field(default=None, repr=False)
    # The ranks of this pipeline stage (None: the whole world, pipeline_parallel_size 1).
    group: Any = field(default=None, repr=False)
    # --enable-expert-parallel: the MoE layers' experts are spread over these ranks
    # (``expert_parallel.py``) instead of each expert's weights being split.
    expert_parallel: bool = False
    # Wall time spent in collectives and how many ran, since the last ``take_comm_time``.
    comm_time_s: float = field(default=0.0, repr=False)
    num_collectives: int = field(default=0, repr=False)
    # Who this rank is in a failed collective's error ("" : "Tensor-parallel rank N"); the
    # groups of ``init_expert_world`` name their engine core.
    label: str = field(default="", repr=False)

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum over the ranks, in place; -> ``t``. bf16/fp16 partial sums are added in fp32 and
        rounded once (not once more per addition), closer to one rank's single rounding."""
        if self.world_size == 1:
            return t
        if t.dtype in (torch.bfloat16, torch.float16):
            wide = t.float()
            self._run("all_reduce", partial(dist.all_reduce, group=self.group), wide)
            return t.copy_(wide)
        self._run("all_reduce", partial(dist.all_reduce, group=self.group), t)
        return t

    def all_gather_last_dim(self, t: torch.Tensor) -> torch.Tensor:
        """[..., n] on every rank -> [..., world_size * n] on every rank (rank order)."""
        if self.world_size == 1:
            return t
        t = t.contiguous()
        parts = [torch.empty_like(t) for _ in range(self.world_size)]
        self._run("all_gather", partial(dist.all_gather, group=self.group), parts, t)
        return torch.cat(parts, dim=-1)

    def all_to_all(self, t: torch.Tensor, send: list[int], recv: list[int]) -> torch.Tensor:
        """Rows [sum(send), ...] -> [sum(recv), ...]: ``send[j]`` rows go to rank j, ``recv[j]``
        come from it (in rank order)."""
        out = t.new_empty((sum(recv), *t.shape[1:]))
        single = partial(
            dist.all_to_all_single,
            output_split_sizes=recv,
            input_split_sizes=send,
            group=self.group,
        )
        self._run("all_to_all", single, out, t.contiguous())
        return out

    def _run(self, op: str, fn: Callable[..., object], *args: object) -> None:
        start = time.perf_counter()
        try:
            fn(*args)
        except RuntimeError as exc:  # gloo / NCCL report a timeout or a lost peer this way
            who = self.label or f"Tensor-parallel rank {self.rank}"
            raise CollectiveTimeoutError(
                f"{who}: {op} failed (a peer rank stopped answering "
                f"within {self.timeout_s:g} s or died): {exc}",
                rank=self.rank,
                op=op,
            ) from exc
        last = args[-1]
        if isinstance(last, torch.Tensor) and last.is_cuda:
            torch.cuda.synchronize()  # the time of the collective, not of its launch
        self.comm_time_s += time.perf_counter() - start
        self.num_collectives += 1

    def take_comm_time(self) -> float:
        """Seconds spent in collectives since the last call (and reset)."""
        spent, self.comm_time_s, self.num_collectives = self.comm_time_s, 0.0, 0
        return spent


_group = TensorParallelGroup()
# Expert parallelism over several engine cores (``-dp N -ep``): every core's ranks, global rank
# d x tp + r of core d's rank r (``init_expert_world``); None: the experts' ranks are the
# tensor-parallel group's.
_ep_group: TensorParallelGroup | None = None


def get_tp_group() -> TensorParallelGroup:
    return _group


def get_ep_group() -> TensorParallelGroup:
    """The ranks the MoE experts are spread over: every engine core's under ``-dp N -ep``,
    else the tensor-parallel group."""
    return _group if _ep_group is None or not _group.expert_parallel else _ep_group


@contextmanager
def unsharded() -> Iterator[None]:
    """Models built (and loaded) inside see one rank: whole layers, no collectives (the
    draft model on the output rank, ``pipeline.whole_model``)."""
    global _group
    saved = _group
    _group = TensorParallelGroup()
    try:
        yield
    finally:
        _group = saved


# The listening socket of the rendezvous, bound by the executor before it started the ranks
# and inherited by rank 0 (``adopt_rendezvous_listener``): the port cannot be taken by another
# program between the executor picking it and rank 0 listening on it.
_inherited_listener: int | None = None


def adopt_rendezvous_listener(fd: int) -> None:
    """Rank 0 serves the rendezvous store on ``fd`` (a TCP socket already listening on
    ``master_port``) instead of binding the port itself."""
    global _inherited_listener
    _inherited_listener = fd


def is_loopback(addr: str) -> bool:
    return addr == "localhost" or addr.startswith("127.") or addr == "::1"


def init_tensor_parallel(
    rank: int,
    world_size: int,
    port: int,
    device: str,
    timeout_s: float,
    *,
    master_addr: str = "127.0.0.1",
    remote_ranks: list[int] | None = None,
    tp_size: int | None = None,
    expert_parallel: bool = False,
) -> TensorParallelGroup:
    """Join the group (blocks until every rank has joined or ``timeout_s`` passes).

    ``rank`` is the global rank of ``world_size``. ``remote_ranks``: the ranks on nodes other
    than node 0; with some, every rank also joins the gloo control group of rank 0 and them
    (``dist.new_group`` is collective). ``tp_size`` below ``world_size`` (pipeline stages):
    this rank's tensor-parallel group is its stage's ``tp_size`` consecutive ranks
    (``trillm/distributed/pipeline.py``). ``expert_parallel``: the group's ranks hold the
    MoE experts whole (``expert_parallel.py``)."""
    tp = world_size if tp_size is None else tp_size
    global _group
    if world_size == 1:
        _group = TensorParallelGroup()
        return _group
    backend = "nccl" if device == "cuda" else "gloo"
    if is_loopback(master_addr):
        # Every rank on this machine: gloo would otherwise pick the interface of the host
        # name. Across machines it does (or GLOO_SOCKET_IFNAME, as for torchrun).
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    timeout = timedelta(seconds=timeout_s)
    listener = _inherited_listener if rank == 0 else None
    store = dist.TCPStore(
        master_addr,
        port,
        world_size,
        is_master=rank == 0,
        timeout=timeout,
        wait_for_workers=False,  # init_process_group waits for every rank itself
        master_listen_fd=listener,
    )
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
    control = None
    if remote_ranks:
        control = dist.new_group([0, *remote_ranks], timeout=timeout, backend="gloo")
    stage_group = None
    for start in range(0, world_size, tp) if tp < world_size else ():  # every rank makes all
        made = dist.new_group(list(range(start, start + tp)), timeout=timeout)
        if start <= rank < start + tp:
            stage_group = made
    _group = TensorParallelGroup(
        rank % tp, tp, timeout_s, control, group=stage_group, expert_parallel=expert_parallel
    )
    return _group


def init_expert_world(
    core: int,
    core_rank: int,
    num_cores: int,
    tp: int,
    store_path: str,
    device: str,
    timeout_s: float,
) -> TensorParallelGroup:
    """Expert parallelism over ``num_cores`` engine cores of ``tp`` ranks each: one world of
    every core's ranks (rendezvous on ``store_path``, a file every rank of this node opens:
    data parallelism runs on one node), the experts' all-to-alls over all of it
    (``get_ep_group``), each core's tensor-parallel collectives over its own ranks (every rank
    makes every core's group: ``dist.new_group`` is collective). Blocks until every rank of
    every core has joined; ``core_rank``: this rank's index in its core; -> its
    tensor-parallel group."""
    global _group, _ep_group
    world = num_cores * tp
    rank = core * tp + core_rank
    backend = "nccl" if device == "cuda" else "gloo"
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # one node (see init_tensor_parallel)
    timeout = timedelta(seconds=timeout_s)
    store = dist.FileStore(store_path, world)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)
    core_group = None
    for start in range(0, world, tp) if tp > 1 else ():
        made = dist.new_group(list(range(start, start + tp)), timeout=timeout)
        if start <= rank < start + tp:
            core_group = made
    _group = TensorParallelGroup(
        core_rank,
        tp,
        timeout_s,
        group=core_group,
        expert_parallel=True,
        label=f"Tensor-parallel rank {core_rank} of engine core {core}",
    )
    _ep_group = TensorParallelGroup(
        rank,
        world,
        timeout_s,
        expert_parallel=True,
        label=expert_rank_label(core, core_rank, tp),
    )
    return _group


def expert_rank_label(core: int, core_rank: int, tp: int) -> str:
    """How a rank of the experts' group over every engine core (``init_expert_world``) is
    named in errors: its rank in that group, its engine core and its rank there."""
    return f"Expert-parallel rank {core * tp + core_rank} (engine core {core}, rank {core_rank})"


def destroy_tensor_parallel() -> None:
    global _group, _ep_group
    if dist.is_initialized():
        dist.destroy_process_group()
    _group = TensorParallelGroup()
    _ep_group = None
