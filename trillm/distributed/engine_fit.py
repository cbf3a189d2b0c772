"""The parallel world resolved for an engine: tensor, pipeline and data parallel sizes checked
against the model's shapes and this node's GPUs (refused by the field's name before anything
loads), then the ``ParallelConfig`` and, on CPU, the ranks' cores."""

from __future__ import annotations

from trillm.config import (
    COLLECTIVE_TIMEOUT_S,
    DEFAULT_MASTER_PORT,
    EngineArgs,
    ModelConfig,
    ParallelConfig,
)


def resolve_parallel(args: EngineArgs, model_config: ModelConfig, device: str) -> ParallelConfig:
    check_tensor_parallel(model_config, args, device)
    check_data_parallel(args, device)
    check_experts_over_cores(model_config, args)
    check_pipeline_parallel(model_config, args, device)
    parallel = parallel_config(args)
    if device == "cpu":  # the ranks' cores: a variable they cannot honour stops the load
        from trillm.distributed.cpu_binding import plan as cpu_binding_plan

        cpu_binding_plan(parallel)
    return parallel


def parallel_config(args: EngineArgs) -> ParallelConfig:
    port = args.master_port
    if port is None:  # one node: the executor picks a free loopback port
        port = DEFAULT_MASTER_PORT if args.nnodes > 1 else 0
    return ParallelConfig(
        tensor_parallel_size=args.tensor_parallel_size,
        data_parallel_size=args.data_parallel_size,
        distributed_executor_backend=args.distributed_executor_backend,
        master_port=port,
        collective_timeout_s=float(args.distributed_timeout_seconds or COLLECTIVE_TIMEOUT_S),
        nnodes=args.nnodes,
        node_rank=args.node_rank,
        master_addr=args.master_addr,
        pipeline_parallel_size=args.pipeline_parallel_size,
        enable_expert_parallel=args.enable_expert_parallel,
    )


def check_experts_over_cores(model_config: ModelConfig, args: EngineArgs) -> None:
    """-dp N -ep: the experts spread over every engine core's ranks, N x tensor_parallel_size
    of them, must split evenly."""
    dp, tp = args.data_parallel_size, args.tensor_parallel_size
    if dp == 1 or not args.enable_expert_parallel:
        return
    from trillm.distributed.expert_parallel_check import check_expert_parallel

    ranks = f"data_parallel_size={dp} x tensor_parallel_size={tp} = {dp * tp}"
    check_expert_parallel(model_config, dp * tp, ranks)
    # Every core's forwards are counted by its engine core; these run forwards it does not
    # count (a draft layer of the target's experts on one rank) or free the experts a
    # sleeping core would still owe the others' steps.
    for name, used in (
        ("speculative_config", args.speculative_config is not None),
        ("enable_sleep_mode", args.enable_sleep_mode),
    ):
        if used:
            raise ValueError(
                f"{name} with enable_expert_parallel and data_parallel_size > 1 is not "
                "implemented yet: the engine cores' forwards must stay in lock-step."
            )


def check_tensor_parallel(model_config: ModelConfig, args: EngineArgs, device: str) -> None:
    """Refuse a tensor_parallel_size the model's shapes (its experts' under expert
    parallelism) or this node's GPUs cannot take (each node runs size / nnodes ranks)."""
    size, nnodes = args.tensor_parallel_size, args.nnodes
    if size == 1:
        return
    from trillm.distributed.sharding import check_divisible

    check_divisible(model_config, size, args.enable_expert_parallel)
    if device == "cuda":
        import torch

        local = size // nnodes
        if torch.cuda.device_count() < local:
            raise ValueError(
                f"tensor_parallel_size={size} over nnodes={nnodes} needs {local} GPUs on "
                "this node (one per rank), "
                f"{torch.cuda.device_count()} visible."
            )


def check_data_parallel(args: EngineArgs, device: str) -> None:
    """Refuse a data_parallel_size the GPUs cannot take: one GPU per rank of every core."""
    size = args.data_parallel_size
    if size == 1 or device != "cuda":
        return
    import torch

    if args.distributed_executor_backend == "uni":
        # NOTE: in-process cores would share this process's current CUDA device.
        raise ValueError("data_parallel_size > 1 on CUDA needs distributed_executor_backend='mp'.")
    needed = size * args.tensor_parallel_size * args.pipeline_parallel_size
    if torch.cuda.device_count() < needed:
        raise ValueError(
            f"data_parallel_size={size} x tensor_parallel_size={args.tensor_parallel_size} "
            f"x pipeline_parallel_size={args.pipeline_parallel_size} needs {needed} GPUs (one per rank of every engine core), "
            f"{torch.cuda.device_count()} visible."
        )


def check_pipeline_parallel(model_config: ModelConfig, args: EngineArgs, device: str) -> None:
    """Refuse a pipeline_parallel_size with more stages than layers, or than GPUs for every
    rank (tensor x pipeline)."""
    size = args.pipeline_parallel_size
    if size == 1:
        return
    layers = model_config.num_hidden_layers
    if size > layers:
        raise ValueError(
            f"pipeline_parallel_size={size} is more stages than the model's {layers} layers."
        )
    world = size * args.tensor_parallel_size
    if device == "cuda":
        import torch

        local = world // args.nnodes  # the ranks on this node
        if torch.cuda.device_count() < local:
            raise ValueError(
                f"tensor_parallel_size x pipeline_parallel_size = {world} ranks over "
                f"nnodes={args.nnodes} needs {local} GPUs on this node (one per rank), "
                f"{torch.cuda.device_count()} visible."
            )
