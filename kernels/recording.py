"""Records the native CPU kernel calls of one forward pass, for ``StepProgram`` replay.

A decode step at batch 1 spends as long in the Python between the native kernels (module calls,
argument checks, views, allocations) as in the kernels themselves: 30 layers x ~12 kernels. A
step program (``trillm/worker/step_program.py``, the CPU counterpart of a CUDA graph) runs a
forward once with a ``Recording`` active, keeps the buffers that forward allocated (a few
reused slabs), and later steps of the same shape call the recorded kernels again with the same
arguments, which point into the same buffers. Each native wrapper in this package calls its kernel through ``call``
(or ``attention`` for the paged-attention plan, which is rebuilt for each step's metadata).

Outside a recording ``call`` is one extra Python call per kernel. ``bind`` turns a recorded call
into a native ``Thunk`` (the call with its arguments converted once), which a native ``Program``
runs without Python between kernels (ext/cpu_program.h).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

# (kernel, arguments, keyword arguments): a plain native call; (None, (plan key,), keyword
# arguments): one run of the step's paged-attention plan for those shapes (its native ``Plan.run``).
Call = tuple[Callable[..., Any] | None, tuple[Any, ...], dict[str, Any]]


class Recording:
    """The kernel calls of one forward, in order."""

    def __init__(self) -> None:
        self.calls: list[Call] = []


class _State(threading.local):
    active: Recording | None = None
    opaque: bool = False  # inside an ``opaque`` call: the step program's torch-op watch looks away


# Per thread: in-process engine cores (data parallelism with the "uni" executor) run their
# forwards at the same time on threads of one process, each recording only its own calls.
_state = _State()


def bind(call: Call, slots: Any, slot_of: dict[Any, int]) -> Any | None:
    """The native ``Thunk`` of a recorded call, or None where it has none (a torch op or an
    opaque Python function: a replay calls those from Python). A paged-attention run is bound to
    its plan's slot in ``slots`` (a native ``PlanSlots``; ``slot_of``: plan key -> slot), which
    the replay fills with its step's plans."""
    kernel, args, kwargs = call
    if kernel is None:
        return slots.bind_run(slot_of[args[0]], **kwargs)
    binder = _binders().get(id(kernel))
    return None if binder is None else binder(*args, **kwargs)


_BINDERS: dict[int, Callable[..., Any]] = {}


def _binders() -> dict[int, Callable[..., Any]]:
    """id(kernel) -> its ``bind_<name>`` for every native kernel that has one."""
    if not _BINDERS:
        from trillm._native import cpu_kernels

        for part in ("gemm", "gemm_bf16", "gemm_fp8", "gemm_q", "ops", "attention", "lora"):
            module = cpu_kernels(part)
            for name in dir(module or ()):
                if name.startswith("bind_"):
                    _BINDERS[id(getattr(module, name[5:]))] = getattr(module, name)
    return _BINDERS


def start() -> Recording:
    """Record every kernel call of this thread from now until ``stop``."""
    if _state.active is not None:
        raise RuntimeError("a recording is already active")
    _state.active = Recording()
    return _state.active


def stop() -> None:
    _state.active = None


def call(kernel: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
    """``kernel(*args, **kwargs)``, recorded when a recording is active."""
    kernel(*args, **kwargs)
    active = _state.active
    if active is not None:
        active.calls.append((kernel, args, kwargs))


def attention(plan: Any, native_plan: Any, **kwargs: Any) -> None:
    """``native_plan.run(**kwargs)`` for ``plan`` (a ``PagedAttentionPlan``), recorded as a run
    of the plan the replayed step builds for the same shapes (``plan.key``)."""
    native_plan.run(**kwargs)
    active = _state.active
    if active is not None:
        active.calls.append((None, (plan.key,), kwargs))


def opaque(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
    """``fn(*args, **kwargs)`` recorded as one call: a Python function of the tensors it is
    given that writes its results into tensors it is given (data-dependent work, e.g. a
    mixture-of-experts layer's routing by expert). Inside it nothing is recorded and the step
    program's watch of torch ops looks away (``in_opaque``); a replay calls it again on the
    same buffers, so its data-dependent choices are made again for the new data."""
    active = _state.active
    if active is None:
        fn(*args, **kwargs)
        return
    _state.active, _state.opaque = None, True
    try:
        fn(*args, **kwargs)
    finally:
        _state.active, _state.opaque = active, False
    active.calls.append((fn, args, kwargs))


def in_opaque() -> bool:
    """Whether this thread is inside an ``opaque`` call of a recording."""
    return _state.opaque
