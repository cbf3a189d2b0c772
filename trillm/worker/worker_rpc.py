"""A worker's side of ``collective_rpc`` (vLLM's): a method called by name on every rank's runner.

Sleep mode's two calls live here too, as vLLM's worker has them: ``sleep(level)`` frees this
rank's KV cache and the step programs captured over it (their replays point into it); at
level 1 the weights go to host memory on an accelerator (``weight_offload.py``; on CPU they
stay where they are, the point being the device's memory), at level 2 the model is dropped
and ``wake_up(["weights"])`` reads it again from disk; ``wake_up(["kv_cache"])`` allocates
the cache again, zeroed (the engine core preempted or aborted every request before the
sleep, so nothing it held is needed).

Only plain data crosses the process boundary: a method is named, never sent as code; its
arguments and result must encode as msgpack.
"""

from __future__ import annotations

import gc
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

if TYPE_CHECKING:
    import torch

    from trillm.interfaces import ModelRunnerProtocol
    from trillm.worker.model_runner import ModelRunner

# NOTE: weight_offload and step_program (torch) are imported where used: the engine core
# reads SLEEP_TAGS from here, and the frontend starts without torch.
SLEEP_TAGS = ("weights", "kv_cache")


class WorkerCallError(ValueError):
    """A collective_rpc method that no runner has, or arguments it refused."""


# The host copies of a level-1 sleeper's weights (on an accelerator), by runner, until wake_up.
_HOST_WEIGHTS: weakref.WeakKeyDictionary[ModelRunner, dict[str, torch.Tensor]] = (
    weakref.WeakKeyDictionary()
)


def kv_cache_bytes(runner: ModelRunner) -> int:
    """Bytes this rank's paged KV cache holds now (0 while asleep)."""
    return sum(t.numel() * t.element_size() for t in runner.kv_caches)


def drop_requests(runner: ModelRunner, req_ids: list[str]) -> None:
    """Forget requests the engine core preempted outside a step (``preempt_running``)."""
    for req_id in req_ids:
        runner._drop(req_id)


def sleep(runner: ModelRunner, level: int, preempted: list[str]) -> int:
    """Forgets the ``preempted`` requests, frees the KV cache (and at level 2 the model);
    -> the KV bytes freed."""
    drop_requests(runner, preempted)
    freed = kv_cache_bytes(runner)
    runner.kv_caches = []
    runner.ssm = None
    if runner.step_programs is not None:  # its captures point into the freed cache
        from trillm.worker.step_program import StepPrograms

        runner.step_programs = StepPrograms(runner.step_programs.model)
    if level == 1 and runner.device.type != "cpu":
        from trillm.worker import weight_offload

        _HOST_WEIGHTS[runner] = weight_offload.offload(runner.model)
    if level == 2:
        runner._model = None
        runner.step_programs = None
        runner.mm = None
        runner.lora = None
    gc.collect()  # the tensors' last references may sit in cycles (the model's modules)
    return freed


def wake_up(runner: ModelRunner, tags: list[str] | None) -> None:
    """``tags``: what to restore (None: both); weights first, the cache beside them."""
    wanted = SLEEP_TAGS if tags is None else tags
    host = _HOST_WEIGHTS.get(runner)
    if "weights" in wanted and host is not None:
        from trillm.worker import weight_offload

        weight_offload.restore(runner.model, host, runner.device)
        del _HOST_WEIGHTS[runner]
    if "weights" in wanted and runner._model is None:
        runner.load_model()
    if "kv_cache" in wanted and not runner.kv_caches:
        runner.initialize_kv_cache(runner.config.cache.num_blocks)


def expert_dummy_forward(runner: ModelRunner, skip: int = 0, agree: bool = True) -> int:
    """-dp N -ep: an idle engine core's rank takes part in the step the other cores run
    (every MoE layer's exchanges but the first ``skip``, nothing else:
    ``fused_moe.exchange_without_tokens``), then in the step's agreement on whose failed
    (``expert_step_faults.agree_step``; ``agree`` False: the rest of a failed step's forward,
    whose worker agrees itself); -> the MoE layers it took part in."""
    from torch import nn

    from trillm.distributed import expert_step_faults
    from trillm.model_executor.layers.fused_moe import exchange_without_tokens

    model = cast(nn.Module, runner.model)
    if agree:
        expert_step_faults.start_forward()
    done = exchange_without_tokens(model, runner.dtype, runner.device, skip)
    if agree:
        expert_step_faults.agree_step(False, runner.device)
    return done


_BUILTINS: dict[str, Callable[..., Any]] = {
    "sleep": sleep,
    "expert_dummy_forward": expert_dummy_forward,
    "wake_up": wake_up,
    "kv_cache_bytes": kv_cache_bytes,
    "drop_requests": drop_requests,
}


def call(runner: ModelRunnerProtocol, method: str, args: list[Any], kwargs: dict[str, Any]) -> Any:
    """``method`` on ``runner`` (a builtin above first, else the runner's public method)."""
    builtin = _BUILTINS.get(method)
    if builtin is not None:
        return builtin(_model_runner(runner, method), *args, **kwargs)
    fn = None if method.startswith("_") else getattr(runner, method, None)
    if not callable(fn):
        raise WorkerCallError(
            f"collective_rpc: the worker has no method {method!r} (a method is named; "
            "callables are not sent to workers)."
        )
    return fn(*args, **kwargs)


def _model_runner(runner: ModelRunnerProtocol, method: str) -> ModelRunner:
    """The builtins reach into trillm's model runner (its cache, model and batch); another
    runner (the fake one, a test's) is refused by name."""
    from trillm.worker.model_runner import ModelRunner  # torch: only once a builtin is named

    if not isinstance(runner, ModelRunner):
        raise WorkerCallError(
            f"collective_rpc {method!r} needs trillm's model runner (its KV cache and model); "
            f"{type(runner).__name__} has neither."
        )
    return runner
