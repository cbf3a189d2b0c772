"""A model worker joining and leaving its tensor- and pipeline-parallel groups (``ModelRunner``
calls these)."""

from __future__ import annotations

import sys

import torch

from trillm.config import TrillmConfig
from trillm.distributed.cpu_binding import bind_rank
from trillm.distributed.expert_parallel import traffic as expert_traffic
from trillm.distributed.parallel_state import (
    destroy_tensor_parallel,
    get_ep_group,
    get_tp_group,
    init_expert_world,
    init_tensor_parallel,
)
from trillm.distributed.pipeline import PipelineGroup, get_pp_group, set_pp_group, stage_layers


def place_rank(config: TrillmConfig, rank: int) -> torch.device:
    """This rank's device: on CUDA one GPU per rank of every engine core on this node (core
    d's rank r on cuda:d*L + r % L, L = the core's ranks on this node); on CPU its cores and
    threads (``cpu_binding``: vLLM's VLLM_CPU_OMP_THREADS_BIND, else a share of the node's)."""
    parallel = config.parallel
    local = parallel.ranks_per_node
    device = torch.device(config.device)
    if device.type == "cuda":
        device = torch.device("cuda", parallel.data_parallel_rank * local + rank % local)
        torch.cuda.set_device(device)
    else:
        bind_rank(parallel, rank)
    return device


def join_tensor_parallel(config: TrillmConfig, rank: int) -> torch.device:
    """Pick this rank's device (``place_rank``), then join the group (blocks until every rank
    has joined) and set this rank's pipeline stage; -> the rank's device. A rank that has
    joined already (rank 0 of a multi-node world joins before it builds its runner) only gets
    its device."""
    parallel = config.parallel
    device = place_rank(config, rank)
    tp, pp = parallel.tensor_parallel_size, parallel.pipeline_parallel_size
    timeout = parallel.collective_timeout_s
    stage = rank // tp
    start, end = stage_layers(config.model.num_hidden_layers, pp, stage)
    set_pp_group(PipelineGroup(stage, pp, rank % tp, tp, start, end, timeout))
    if torch.distributed.is_initialized():  # rank 0 of several nodes (tp_size may be 1)
        return device
    if parallel.experts_span_cores:  # -dp N -ep: one world of every core's ranks
        core = parallel.data_parallel_rank
        size = parallel.data_parallel_size
        init_expert_world(core, rank, size, tp, parallel.expert_store, device.type, timeout)
        return device
    init_tensor_parallel(
        rank,
        parallel.world_size,
        parallel.master_port,
        device.type,
        timeout,
        master_addr=parallel.master_addr,
        remote_ranks=parallel.remote_ranks(),
        tp_size=tp,
        expert_parallel=parallel.enable_expert_parallel,
    )
    return device


def leave_tensor_parallel(rank: int, num_steps: int) -> None:
    """Say how long this rank spent in collectives, and under expert parallelism the bytes it
    sent in the experts' all-to-alls (benchmarks/parallel/tensor_parallel.py and
    expert_parallel.py read the line; the experts over several engine cores: the line names
    the rank's core, and its collectives include the experts' exchanges), then leave the
    group."""
    tp, ep = get_tp_group(), get_ep_group()
    spent = tp.take_comm_time() + get_pp_group().comm_time_s  # + stage hand-offs
    core = ""
    if ep is not tp:  # -dp N -ep
        spent += ep.take_comm_time()
        core = f" of engine core {ep.rank // tp.world_size}"
    per_step = 1e3 * spent / max(1, num_steps)
    sent, exchanges = expert_traffic.take()
    experts = f", {sent} bytes sent in {exchanges} expert all-to-alls" if exchanges else ""
    line = (
        f"tensor-parallel rank {rank}{core}: {num_steps} forward steps, {spent:.3f} s in "
        f"collectives ({per_step:.3f} ms per step){experts}\n"
    )
    sys.stderr.write(line)  # one write: the ranks print at the same moment
    sys.stderr.flush()
    destroy_tensor_parallel()
    set_pp_group(PipelineGroup())
