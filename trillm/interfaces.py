"""The contracts between trillm's parts, typed, in one place.

- The model runner (``ModelRunnerProtocol``, below): what a model-worker process calls on the
  runner it loads (``trillm.worker.model_runner.ModelRunner``, the pooling runner, the fake
  runner and the test runners all conform; mypy checks each against it).
- The executor: ``trillm.executor.abstract.Executor``, an abstract class (it carries defaults
  for the batch-queue and failure-watching parts); every executor, stand-ins in tests
  included, subclasses it.
- The engine as a request sees it (``RequestEngine``, below): what ``request_stream.py``'s
  parent requests call to submit and abort (``trillm.engine.request_inbox.RequestInbox``,
  which ``AsyncEngine`` hands them).
- The scheduler: the Python twin's class, ``trillm.core.scheduler.Scheduler``; the native
  scheduler is declared with the twin's API (``trillm/_ext/scheduler.pyi``) and checked against
  it (``tests/native/test_native_contract.py``).
- The tokenizer: ``trillm.tokenizer_protocol.Tokenizer``, what trillm calls on the
  transformers tokenizer it loads (``trillm.engine.tokenizer_loader.load_tokenizer``, the one
  place transformers' untyped object becomes this type). It lives in a module of its own that
  imports nothing of trillm: the stages that take a tokenizer (stage 2's preprocessing, the
  parsers) sit below the modules named here, and importing this module from them would close
  import cycles (``tests/repo/test_import_graph.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    from trillm.engine.preprocess import Preprocessor
    from trillm.lora.request import LoRARequest
    from trillm.messages import AbortRequest, AddRequest, ModelRunnerOutput, SchedulerOutput
    from trillm.sampling_params import SamplingParams
    from trillm.worker.step_sampling import PendingStep

# req_id -> the grammar's allowed-token bitmask row: int32 words, packed (bytes) or listed
Bitmask = dict[str, bytes | list[int]]


class ModelRunnerProtocol(Protocol):
    """A model-worker's runner, in the order the worker calls it: built with (config, rank,
    **runner_kwargs); ``load_model``; ``determine_num_blocks``; ``initialize_kv_cache``; then
    per step ``execute_model`` (P2) and ``sample_tokens`` (P3); ``shutdown`` on the way out."""

    def load_model(self) -> None: ...

    def determine_num_blocks(self) -> int: ...

    def initialize_kv_cache(self, num_blocks: int) -> None: ...

    def execute_model(self, sched: SchedulerOutput) -> None: ...

    def sample_tokens(self, bitmask: Bitmask | None) -> ModelRunnerOutput: ...

    def shutdown(self) -> None: ...


@runtime_checkable
class PendingStepRunner(Protocol):
    """A runner that shows the step P2 left for P3 (``ModelRunner``): under -dp N -ep, a step
    whose tokens went to experts that failed then fails only those tokens' requests
    (``trillm.distributed.expert_step_faults.requests_of``); with another runner, the whole
    step fails."""

    def pending_step(self) -> PendingStep | None: ...


# A runner class: (config, rank, **runner_kwargs) -> a runner.
RunnerClass = Callable[..., ModelRunnerProtocol]

if TYPE_CHECKING:  # mypy checks every runner trillm ships against the contract
    from trillm.testing.scripted_runner import ScriptedRunner
    from trillm.testing.slow_runner import SlowPoolingRunner
    from trillm.worker.fake_runner import FakeModelRunner
    from trillm.worker.model_runner import ModelRunner
    from trillm.worker.pooling_runner import PoolingModelRunner

    _RUNNERS: tuple[RunnerClass, ...] = (
        ModelRunner,
        PoolingModelRunner,
        FakeModelRunner,
        ScriptedRunner,
        SlowPoolingRunner,
    )
    _SHOWS_PENDING: tuple[Callable[..., PendingStepRunner], ...] = (ModelRunner,)


class RequestEngine(Protocol):
    """What a request needs of the engine (``RequestInbox``): stage 2, the adapter and grammar
    checks, and the output handler's inbox."""

    preprocessor: Preprocessor
    stream_interval: int

    def check_alive(self) -> None: ...

    async def check_lora(self, lora: LoRARequest) -> None: ...

    async def compile_grammar(self, params: SamplingParams) -> None: ...

    def try_send_to_handler(self, msg: AddRequest) -> bool: ...

    async def send_to_handler(self, msg: AddRequest) -> None: ...

    async def send_abort(self, msg: AbortRequest) -> None: ...
