"""Control messages between the executor and its worker processes (startup and shutdown).

The per-step messages (``SchedulerOutput``, ``SampleRequest``, ``ModelRunnerOutput``) live in
``trillm/messages.py``; these only exist on the executor <-> worker link.

Startup handshake, per worker (every rank reads every request-ring message):
  executor -> ``InitWorker``      worker builds the runner, ``load_model()``,
  worker   -> ``WorkerReady(phase="loaded", num_blocks=runner.determine_num_blocks())``
  executor -> ``InitKVCache(min over ranks)``   worker ``initialize_kv_cache(n)``,
  worker   -> ``WorkerReady(phase="kv_cache")``
then steps (and between them ``WorkerCall``s, each answered by every rank with a
``WorkerCallResult``: ``collective_rpc``, sleep mode), then ``Shutdown`` (the worker exits 0). A fatal worker error is answered with
``WorkerFailed`` (before the worker exits 1); a per-step error travels as
``ModelRunnerOutput.error``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from trillm.config import TrillmConfig


@dataclass(slots=True)
class InitWorker:
    config: TrillmConfig
    runner: str  # "package.module:ClassName", constructed as Class(config, rank, **runner_kwargs)
    runner_kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass(slots=True)
class InitKVCache:
    num_blocks: int


@dataclass(slots=True)
class Shutdown:
    pass


@dataclass(slots=True)
class WorkerCall:
    """``collective_rpc``: ``method`` called on every rank's runner (``worker/worker_rpc.py``)."""

    method: str
    args: list[Any] = field(default_factory=list)
    kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass(slots=True)
class WorkerCallResult:
    rank: int
    value: Any = None  # the method's result (plain data)
    error: str | None = None  # what it raised, formatted (the rank carries on)


@dataclass(slots=True)
class WorkerReady:
    rank: int
    phase: str  # "loaded" | "kv_cache"
    num_blocks: int = 0  # the runner's determine_num_blocks() (phase "loaded")


@dataclass(slots=True)
class WorkerFailed:
    rank: int
    message: str  # the formatted traceback
    # A tensor-parallel collective timed out here: the executor names the ranks that did not
    # report one (the ones that stopped answering).
    collective: bool = False
