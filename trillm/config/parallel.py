"""The parallel world ``EngineArgs`` asks for (tensor, pipeline and data parallel sizes,
nodes, the rendezvous port and the collectives' timeout), refused by the field's name when it
cannot be formed."""

from __future__ import annotations

import importlib.util
from typing import Protocol


class ParallelArgs(Protocol):
    """The fields of ``EngineArgs`` read here (a Protocol: engine_args.py imports this
    module)."""

    @property
    def tensor_parallel_size(self) -> int: ...
    @property
    def data_parallel_size(self) -> int: ...
    @property
    def pipeline_parallel_size(self) -> int: ...
    @property
    def distributed_executor_backend(self) -> str: ...
    @property
    def nnodes(self) -> int: ...
    @property
    def node_rank(self) -> int: ...
    @property
    def master_port(self) -> int | None: ...
    @property
    def distributed_timeout_seconds(self) -> float | None: ...
    @property
    def enable_expert_parallel(self) -> bool: ...


def check_parallel(args: ParallelArgs) -> None:
    """The sizes, then the nodes: ValueError naming the field."""
    for name in ("tensor_parallel_size", "data_parallel_size", "pipeline_parallel_size"):
        value = getattr(args, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}.")
    for name in ("tensor_parallel_size", "pipeline_parallel_size"):
        if getattr(args, name) > 1 and args.distributed_executor_backend == "uni":
            raise ValueError(
                f"{name} > 1 needs distributed_executor_backend='mp' or 'ray' (one "
                "worker per rank); 'uni' runs one rank in this process."
            )
    if args.distributed_executor_backend == "ray":
        check_ray(args)
    check_nodes(args)
    check_expert_parallel_layout(args)


def check_expert_parallel_layout(args: ParallelArgs) -> None:
    """Expert parallelism spreads the experts over the tensor-parallel ranks of one engine
    core (of each pipeline stage, which holds its own layers' experts), or with
    data_parallel_size > 1 over every core's ranks (vLLM's -dp N -ep: the cores step in
    lock-step, engine/dp_lockstep.py); what that does not cover is refused by name."""
    if not (args.enable_expert_parallel and args.data_parallel_size > 1):
        return
    if args.pipeline_parallel_size > 1:
        raise ValueError(
            "enable_expert_parallel with data_parallel_size > 1 and pipeline_parallel_size > 1 "
            "is not implemented yet: the experts spread over several engine cores' ranks need "
            "one step in flight per core."
        )
    if args.distributed_executor_backend != "mp":
        raise ValueError(
            "enable_expert_parallel with data_parallel_size > 1 needs "
            "distributed_executor_backend='mp': every engine core's ranks join one process "
            "group, one worker process per rank."
        )


def check_ray(args: ParallelArgs) -> None:
    """Ray installed, and one engine core whose ranks are all Ray actors."""
    if importlib.util.find_spec("ray") is None:
        raise ValueError(
            "distributed_executor_backend='ray' needs Ray, which is not installed: "
            "pip install 'trillm[ray]' (or pip install 'ray>=2.9')."
        )
    if args.data_parallel_size > 1:
        raise ValueError(
            "data_parallel_size > 1 with distributed_executor_backend='ray' is not supported: "
            "use 'mp' for data parallelism."
        )


DEFAULT_MASTER_PORT = 29500  # torchrun's


def check_nodes(args: ParallelArgs) -> None:
    """Refuse node settings that cannot form the world: ValueError naming the field."""
    nnodes, node_rank = args.nnodes, args.node_rank
    tp, pp = args.tensor_parallel_size, args.pipeline_parallel_size
    if isinstance(nnodes, bool) or not isinstance(nnodes, int) or nnodes < 1:
        raise ValueError(f"nnodes must be an integer >= 1, got {nnodes!r}.")
    if isinstance(node_rank, bool) or not isinstance(node_rank, int) or not 0 <= node_rank < nnodes:
        raise ValueError(
            f"node_rank must be an integer in [0, nnodes={nnodes}), got {node_rank!r}."
        )
    if (tp * pp) % nnodes:
        raise ValueError(
            f"nnodes={nnodes} must divide tensor_parallel_size={tp} x pipeline_parallel_size="
            f"{pp} (each node runs tensor_parallel_size x pipeline_parallel_size / nnodes ranks)."
        )
    if nnodes > 1 and args.distributed_executor_backend != "mp":
        raise ValueError("nnodes > 1 needs distributed_executor_backend='mp'.")
    if args.data_parallel_size > 1 and (nnodes > 1 or args.master_port is not None):
        raise ValueError(
            "data_parallel_size > 1 with nnodes > 1 or a master_port is not implemented yet"
            ": each engine core's ranks meet at a loopback port of their own."
        )
    port = args.master_port
    if port is not None and (
        isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536
    ):
        raise ValueError(f"master_port must be a TCP port in [1, 65535], got {port!r}.")
    timeout = args.distributed_timeout_seconds
    if timeout is not None and (
        isinstance(timeout, bool)
        or not isinstance(timeout, (int, float))
        or not 0 < timeout < float("inf")
    ):
        raise ValueError(f"distributed_timeout_seconds must be a number > 0, got {timeout!r}.")
