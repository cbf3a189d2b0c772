"""Stage 4: the Trio engine API (``open_engine`` / ``AsyncEngine``).

``open_engine`` builds the configuration, starts the executor (workers + KV cache), then runs
two long-lived tasks in one nursery, both started with ``nursery.start`` so they are up when
the caller gets the engine:

- the engine-core task (``trillm/engine/core.py``): schedule -> execute -> sample -> update;
- the output handler: EngineCoreOutputs -> detokenize, stop strings, logprobs -> collectors.

``generate`` submits one request and yields its ``RequestOutput``s from a per-request
collector. Leaving the ``async for`` (or cancelling the caller) aborts the request.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import math
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import trio

from trillm.config import EngineArgs, TrillmConfig
from trillm.engine.chat_template import load_chat_template
from trillm.engine.output_processor import DEFAULT_WAKE_BUDGET, OutputProcessor
from trillm.engine.preprocess import InvalidRequestError, PreparedPrompt, Preprocessor, PromptType
from trillm.errors import EngineDeadError
from trillm.lora.checker import LoRAChecker
from trillm.lora.request import LoRARequest
from trillm.messages import AbortRequests, EngineCoreOutputs, EngineCoreRequest, SchedulerStats
from trillm.outputs import RequestOutput
from trillm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

_OUTPUT_CHANNEL_SIZE = 4  # steps in flight between the engine core and the output handler


class AsyncEngine:
    """Handle to a running engine; get one from ``open_engine``."""

    def __init__(
        self,
        config: TrillmConfig,
        tokenizer: Any,
        executor: Any,
        stream_interval: int = 1,
        stream_wake_budget: int | None = DEFAULT_WAKE_BUDGET,
        chat_template: str | None = None,
    ) -> None:
        from trillm._native import get_scheduler_cls
        from trillm.engine.core import EngineCore

        self.config = config
        self.model_config = config.model
        self.tokenizer = tokenizer
        self.executor = executor
        # Stage 2 (render, tokenize, truncate, validate), shared with the HTTP layer.
        self.preprocessor = Preprocessor(config, tokenizer, executor.num_blocks, chat_template)
        self.output_processor = OutputProcessor(
            tokenizer, stream_interval=stream_interval, wake_budget=stream_wake_budget
        )
        scheduler = get_scheduler_cls()(config.scheduler, config.cache, executor.num_blocks)
        self.structured_output = _structured_output_manager(config, tokenizer)
        lora = None
        if config.lora is not None:
            from trillm.lora.admission import LoRAAdmission

            lora = LoRAAdmission(config.lora.max_loras)
        self.core = EngineCore(scheduler, executor, self.structured_output, lora)
        # Adapters checked against the model (trillm/lora/checker.py), with --enable-lora.
        self.lora_checker = None if config.lora is None else LoRAChecker(config)
        self._input_send, self._input_recv = trio.open_memory_channel[Any](math.inf)
        self._stats = SchedulerStats()
        # Called with each step's computed-token count (the metrics' iteration_tokens_total).
        self.step_observers: list[Callable[[int], None]] = []
        self._ids = itertools.count()
        self.dead_error: EngineDeadError | None = None
        self.died = trio.Event()  # set with dead_error (the server exits on it)
        self.is_running = False

    # ------------------------------------------------------------------ status
    @property
    def is_dead(self) -> bool:
        return self.dead_error is not None

    @property
    def num_blocks(self) -> int:
        return self.executor.num_blocks

    def get_stats(self) -> SchedulerStats:
        return self._stats

    # ------------------------------------------------------------------ tasks
    async def run_core(self, *, task_status: trio.TaskStatus = trio.TASK_STATUS_IGNORED) -> None:
        from trillm.engine.core import run_engine_core

        send, recv = trio.open_memory_channel[EngineCoreOutputs](_OUTPUT_CHANNEL_SIZE)
        self._outputs_recv = recv
        try:
            async with trio.open_nursery() as nursery:
                await nursery.start(self._run_output_handler, recv)
                await nursery.start(run_engine_core, self.core, self._input_recv, send)
                self.is_running = True
                task_status.started()
        except Exception as exc:  # the engine is gone: fail everything, keep the process up
            self._die(exc)
        finally:
            self.is_running = False

    async def _run_output_handler(
        self,
        outputs: trio.MemoryReceiveChannel[EngineCoreOutputs],
        *,
        task_status: trio.TaskStatus = trio.TASK_STATUS_IGNORED,
    ) -> None:
        task_status.started()
        async with outputs:
            async for batch in outputs:
                if batch.scheduler_stats is not None:
                    self._stats = batch.scheduler_stats
                if batch.num_scheduled_tokens:
                    for observe in self.step_observers:
                        observe(batch.num_scheduled_tokens)
                to_abort = self.output_processor.process_outputs(
                    batch.outputs, model_time_s=batch.model_time_s
                )
                if to_abort:
                    self._input_send.send_nowait(AbortRequests(to_abort))

    def _die(self, exc: BaseException) -> None:
        if isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
            exc = exc.exceptions[0]
        if isinstance(exc, EngineDeadError):
            error = exc
        else:
            logger.exception("engine core failed", exc_info=exc)
            error = EngineDeadError(f"The engine core failed: {type(exc).__name__}: {exc}")
            error.__cause__ = exc
        self.dead_error = error
        self.died.set()
        self.output_processor.fail_all(error)

    # ------------------------------------------------------------------ requests
    def check_alive(self) -> None:
        if self.dead_error is not None:
            raise self.dead_error

    @property
    def chat_template(self) -> str | None:
        """``--chat-template`` (loaded text), None when the tokenizer's is used."""
        return self.preprocessor.chat_template

    async def generate(
        self,
        prompt: PromptType | PreparedPrompt,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        *,
        priority: int = 0,
        cache_salt: str | None = None,
        timeout: float | None = None,  # noqa: ASYNC109 - the request's deadline, not this call's
        lora_request: LoRARequest | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Submit one request and yield its outputs until it finishes.

        ``prompt``: a string, a dict (``prompt_token_ids`` / ``prompt``), or a
        ``PreparedPrompt`` from ``self.preprocessor`` (the HTTP layer's: already checked, so
        ``params``, ``priority`` and ``cache_salt`` come from it and nothing is checked again).
        ``timeout``: seconds after which the request is aborted and its last output carries
        ``finish_reason == "timeout"`` (what it produced until then is kept).
        ``lora_request``: the adapter to run with (needs ``enable_lora``)."""
        self.check_alive()
        deadline = _deadline(timeout)
        if lora_request is not None:
            await self.check_lora(lora_request)
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        if isinstance(prompt, PreparedPrompt):
            prepared = prompt
        else:
            prepared = await self.preprocessor.prepare(
                prompt, params or SamplingParams(), priority=priority, cache_salt=cache_salt
            )
        params = prepared.params
        text = prepared.text
        request = EngineCoreRequest(
            request_id=request_id,
            prompt_token_ids=prepared.prompt_token_ids,
            sampling_params=params,
            arrival_time=time.monotonic(),
            eos_token_id=self.preprocessor.eos_token_id,
            priority=prepared.priority,
            cache_salt=prepared.cache_salt,
            extra_hash_keys=[] if lora_request is None else [lora_request.hash_key],
            lora_request=lora_request,
        )
        if params.structured_outputs is not None:
            await self._compile_grammar(params)
        children = self._fan_out(request)
        collector = self.output_processor.add_request(
            request_id, text, request.prompt_token_ids, params, [c.request_id for c in children]
        )
        try:
            for child in children:
                self._input_send.send_nowait(child)
            while True:
                if deadline == math.inf:  # (no cancel scope on the common path)
                    out = await collector.get()
                else:
                    # NOTE: the deadline's scope covers only the wait, never the yield.
                    got: RequestOutput | None = None
                    with trio.move_on_at(deadline):
                        got = await collector.get()
                    out = got or self._expire(request_id, children, collector)
                yield out
                if out.finished:
                    return
        finally:
            # Sync on purpose: runs even while the caller is being cancelled.
            if self.output_processor.abort_request(request_id):
                self._input_send.send_nowait(AbortRequests([c.request_id for c in children]))

    async def check_lora(self, lora: LoRARequest) -> None:
        """InvalidRequestError (a 400) unless LoRA is on and the adapter fits the model."""
        if self.lora_checker is None:
            raise InvalidRequestError(
                "LoRA adapters need the engine started with enable_lora (--enable-lora).",
                "lora_request",
            )
        await self.lora_checker.check(lora)

    async def _compile_grammar(self, params: SamplingParams) -> None:
        """Structured outputs: compile (off the event loop, time-limited, cached) before the
        engine sees the request, so a bad schema / regex / grammar is refused here (a 400).
        A cached grammar costs no await."""
        from trillm.structured_output import check_params

        if self.structured_output is None:
            raise InvalidRequestError(
                "Structured outputs need the model's tokenizer.", "structured_outputs"
            )
        spec = check_params(params.structured_outputs)
        cache = self.structured_output.cache
        if cache.get(spec) is None:
            await cache.compile(spec)

    def _expire(self, request_id: str, children: list[Any], collector: Any) -> RequestOutput:
        """The request's deadline passed: abort it; its last output says "timeout"."""
        if self.output_processor.abort_request(request_id):
            self._input_send.send_nowait(AbortRequests([c.request_id for c in children]))
        out = collector.get_nowait()  # the abort's final output (raises if the engine died)
        if out is None:  # pragma: no cover - abort_request always delivers a final output
            raise RuntimeError(f"request {request_id} timed out without a final output")
        for c in out.outputs:
            if c.finish_reason == "abort":
                c.finish_reason = "timeout"
        return out

    def _fan_out(self, request):
        """n > 1: one engine request per sample (seeded ones get seed + index)."""
        params = request.sampling_params
        if params.n == 1:
            return [request]
        children = []
        for index in range(params.n):
            child_params = params.clone()
            child_params.n = 1
            if params.seed is not None:
                # Wrapped into int64: seed 2**63 - 1 with n = 2 stays encodable.
                child_params.seed = (params.seed + index + 2**63) % 2**64 - 2**63
            children.append(
                dataclasses.replace(
                    request,
                    request_id=f"{index}_{request.request_id}",
                    sampling_params=child_params,
                )
            )
        return children

    async def chat(
        self,
        messages: list[dict[str, Any]],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        *,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: dict[str, Any] | None = None,
        tools: list[dict[str, Any]] | None = None,
        documents: list[dict[str, Any]] | None = None,
        **kwargs: Any,
    ) -> AsyncIterator[RequestOutput]:
        # ``tools`` / ``documents`` reach the chat template (OpenAI's tool dicts); parsing the
        # calls out of the output is LLM.chat's tool_parser (trillm.parsers.tool_parsers).
        prompt = self.render_chat(
            messages,
            chat_template=chat_template,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            chat_template_kwargs=chat_template_kwargs,
            tools=tools,
            documents=documents,
        )
        async for out in self.generate(prompt, params, request_id, **kwargs):
            yield out

    def render_chat(self, messages: list[dict[str, Any]], **options: Any) -> dict[str, Any]:
        """The chat as a prompt for ``generate``; ``chat_template``: a path or the text."""
        template = load_chat_template(options.pop("chat_template", None))
        text = self.preprocessor.render_chat(messages, chat_template=template, **options)
        return {"prompt": text, "add_special_tokens": False}

    async def abort(self, request_id: str) -> None:
        ids = self.output_processor.child_ids(request_id)
        if self.output_processor.abort_request(request_id):
            self._input_send.send_nowait(AbortRequests(ids))
        await trio.lowlevel.checkpoint()


def _deadline(timeout: float | None) -> float:
    """The Trio clock's deadline for ``timeout`` seconds from now (inf: none)."""
    if timeout is None:
        return math.inf
    if not isinstance(timeout, (int, float)) or not 0 < timeout < math.inf:
        raise InvalidRequestError(f"timeout must be a positive number, got {timeout!r}.", "timeout")
    return trio.current_time() + timeout


def _structured_output_manager(config: TrillmConfig, tokenizer: Any) -> Any:
    """The grammar cache and matchers (xgrammar needs the tokenizer's vocabulary)."""
    from trillm.structured_output import GrammarCache, StructuredOutputManager

    if tokenizer is None:
        return None
    cache = GrammarCache(tokenizer, config.model.vocab_size, list(config.model.eos_token_ids))
    return StructuredOutputManager(cache, config.reasoning_parser)


@asynccontextmanager
async def open_engine(
    model: str | None = None,
    *,
    runner: str | None = None,
    runner_kwargs: dict[str, Any] | None = None,
    stream_wake_budget: int | None = DEFAULT_WAKE_BUDGET,
    **engine_args: Any,
) -> AsyncIterator[AsyncEngine]:
    """``async with open_engine(model, **engine_args) as engine:`` (vLLM's argument names).

    ``runner`` swaps the model runner (``"trillm.worker.fake_runner:FakeModelRunner"`` for a
    near-zero-cost model in frontend tests and benchmarks). ``stream_wake_budget``: the most
    streams woken per step for a middle output (None: no budget; see ``output_processor``)."""
    from trillm.engine.config_builder import build_config, load_tokenizer
    from trillm.executor.abstract import DEFAULT_RUNNER
    from trillm.executor.factory import open_executor

    args = EngineArgs.from_kwargs(model, **engine_args)
    config = await trio.to_thread.run_sync(build_config, args)
    tokenizer = await trio.to_thread.run_sync(
        load_tokenizer, config.model.tokenizer, args.trust_remote_code
    )
    async with open_executor(config, runner or DEFAULT_RUNNER, runner_kwargs) as executor:
        engine = AsyncEngine(
            config, tokenizer, executor, args.stream_interval, stream_wake_budget,
            args.chat_template,
        )  # fmt: skip
        logger.info(
            "engine ready: model %s, %d KV blocks of %d tokens, device %s, attention %s",
            config.model.served_model_name,
            executor.num_blocks,
            config.cache.block_size,
            config.device,
            config.attention_backend,
        )
        async with trio.open_nursery() as nursery:
            await nursery.start(engine.run_core)
            try:
                yield engine
            finally:
                nursery.cancel_scope.cancel()
