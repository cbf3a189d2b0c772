"""``open_engine``: the Trio engine started and closed with an ``async with`` block.

It builds the configuration, starts the executors (workers + KV cache) while the tokenizer
loads, builds the ``AsyncEngine`` (``async_engine.py``) and runs its tasks
(``AsyncEngine.run_core``: the engine cores and the output handler) in one nursery, cancelled
when the block ends.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

import outcome
import trio

from trillm.config import EngineArgs
from trillm.config.batch_defaults import UsageContext
from trillm.config.observability import collected_times, detailed_trace_modules
from trillm.engine.async_engine import AsyncEngine
from trillm.engine.dp_router import core_configs
from trillm.engine.stream_pacing import DEFAULT_WAKE_BUDGET

if TYPE_CHECKING:
    from trillm.tokenizer_protocol import Tokenizer

# The name the "engine ready" line has always been logged under.
logger = logging.getLogger("trillm.engine.async_engine")


def _require_trio() -> None:
    """``open_engine`` is Trio code; under asyncio (or any other loop) say what to use."""
    try:
        trio.lowlevel.current_trio_token()
    except RuntimeError:
        raise RuntimeError(
            "open_engine runs under Trio (trio.run). From asyncio code use trillm.AsyncLLM, "
            "which runs the engine on a Trio thread of its own: "
            "`async for out in AsyncLLM(model).generate(prompt, params, request_id)`."
        ) from None


def _tokenizer(path: str, trust_remote_code: bool, skip: bool) -> Tokenizer:
    """The model's tokenizer; with ``--skip-tokenizer-init`` none is loaded (its stand-in)."""
    from trillm.engine.skipped_tokenizer import SkippedTokenizer
    from trillm.engine.tokenizer_loader import load_tokenizer

    return SkippedTokenizer() if skip else load_tokenizer(path, trust_remote_code)


@asynccontextmanager
async def _load_in_background(
    fn: Callable[..., Any], *args: Any
) -> AsyncIterator[Callable[[], Awaitable[Any]]]:
    """``fn(*args)`` started on a thread while the block runs; the block gets a function that
    waits for its result (or raises its error). Leaving the block waits for the thread, also
    when the block fails or is cancelled (a worker refused to start): a load left running
    outlives the engine, and its first import of transformers, half done, breaks the caller's
    own (``cannot import name 'AutoTokenizer' from 'transformers'``)."""
    token = trio.lowlevel.current_trio_token()
    done = trio.Event()
    result: list[outcome.Outcome[Any]] = []

    def work() -> None:
        result.append(outcome.capture(fn, *args))
        trio.from_thread.run_sync(done.set, trio_token=token)

    # daemon: a load that never returns does not keep the interpreter from exiting
    thread = threading.Thread(target=work, name="trillm-load", daemon=True)
    thread.start()

    async def wait() -> Any:
        await done.wait()
        return result[0].unwrap()

    try:
        yield wait
    finally:
        with trio.CancelScope(shield=True):
            await done.wait()
            # ``done`` is set from the thread before it returns: wait for its end too, so no
            # part of the load outlives the block
            await trio.to_thread.run_sync(thread.join)


@asynccontextmanager
async def open_engine(
    model: str | None = None,
    *,
    runner: str | None = None,
    runner_kwargs: dict[str, Any] | None = None,
    stream_wake_budget: int | None = DEFAULT_WAKE_BUDGET,
    collect_detailed_traces: Sequence[str] | None = None,
    usage_context: UsageContext = UsageContext.ENGINE_CONTEXT,
    **engine_args: Any,
) -> AsyncIterator[AsyncEngine]:
    """``async with open_engine(model, **engine_args) as engine:`` (vLLM's argument names).

    ``runner``: vLLM's kind (``"pooling"`` for an embedding model) or a model runner class as
    ``"module:Class"`` (``"trillm.worker.fake_runner:FakeModelRunner"``: a near-zero-cost
    model for frontend tests and benchmarks). ``stream_wake_budget``: the most
    streams woken per step for a middle output (None: no budget; see ``output_processor``).
    ``collect_detailed_traces``: vLLM's modules (``config/observability.py``), the times each
    finished sample's ``CompletionOutput`` carries (``trillm serve`` passes its flag's).
    ``usage_context``: what makes the engine (``trillm serve``, ``LLM``), for the defaults
    vLLM picks by it (``config/batch_defaults.py``)."""
    from trillm.engine.config_builder import build_config
    from trillm.executor.abstract import DEFAULT_RUNNER, ENCODER_RUNNER, POOLING_RUNNER
    from trillm.executor.factory import open_executors
    from trillm.model_executor.encoder_config import is_encoder

    _require_trio()
    if runner is not None and ":" not in runner:  # vLLM's runner kind, not a class path
        engine_args["runner"], runner = runner, None
    args = EngineArgs.from_kwargs(model, **engine_args)
    traces = detailed_trace_modules(collect_detailed_traces or ())
    config = await trio.to_thread.run_sync(build_config, args, usage_context)
    config.collect_model_forward_time, config.collect_model_execute_time = collected_times(traces)
    default = POOLING_RUNNER if config.pooler is not None else DEFAULT_RUNNER
    if is_encoder(config.model.architecture):
        default = ENCODER_RUNNER
    configs = core_configs(config)
    # The tokenizer loads while the workers start (transformers' import alone is seconds).
    async with (
        _load_in_background(
            _tokenizer, config.model.tokenizer, args.trust_remote_code, args.skip_tokenizer_init
        ) as tokenizer_loaded,
        open_executors(configs, runner or default, runner_kwargs) as executors,
    ):
        tokenizer = await tokenizer_loaded()
        engine = AsyncEngine(
            configs[0],
            tokenizer,
            executors,
            args.stream_interval,
            stream_wake_budget,
            args.chat_template,
        )
        logger.info(
            "engine ready: model %s, %d engine core(s) of %d KV blocks of %d tokens, device %s, "
            "attention %s",
            config.model.served_model_name,
            len(executors),
            engine.num_blocks,
            config.cache.block_size,
            config.device,
            config.attention_backend,
        )
        try:
            async with trio.open_nursery() as nursery:
                await nursery.start(engine.run_core)
                try:
                    yield engine
                finally:
                    nursery.cancel_scope.cancel()
        finally:
            # NOTE: its tasks ended: a KV connector's ports and threads, off the loop (bounded,
            # yet it joins threads) and shielded (this may run cancelled)
            with trio.CancelScope(shield=True):
                await trio.to_thread.run_sync(engine.engine_cores.close)
