"""Stage 4: the Trio engine API (``AsyncEngine``; started by ``engine_startup.open_engine``).

The engine runs two long-lived tasks (``run_core``), both started with ``nursery.start`` so
they are up when the caller gets the engine:

- the engine-core task (``trillm/engine/core.py``): schedule -> execute -> sample -> update;
  with ``data_parallel_size`` K, K of them, each with its own scheduler, KV cache and
  executor (workers), held with their inputs, stats and router by ``engine_cores.py``;
- the output handler (``output_handler.py``): EngineCoreOutputs -> detokenize, stop strings,
  logprobs -> collectors; and, in the same task because only it touches the output
  processor, admission: new requests (``AddRequest``) and aborts reach it, in order, over one
  bounded inbox, each new request going to the engine core the router picks
  (``dp_router.py``), each abort to the core that holds the request.

``async with engine.generate(...) as outputs: async for out in outputs`` submits one request
and reads its ``RequestOutput``s from a per-request collector; ``generate_many`` does the same
for several prompts as one parent request (``request_stream.py``: the one submit path of every
front). Leaving the block before the final output (break, exception, cancellation) aborts
the request.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import trio

from trillm.config import TrillmConfig
from trillm.engine.chat_media import multi_modal_data, split_chat_images
from trillm.engine.chat_template import load_chat_template
from trillm.engine.engine_control import EngineControl
from trillm.engine.engine_cores import EngineCores, structured_output_manager
from trillm.engine.output_handler import OutputHandler
from trillm.engine.output_processor import OutputProcessor
from trillm.engine.pooling_requests import pool
from trillm.engine.preprocess import InvalidRequestError, PreparedPrompt, Preprocessor, PromptType
from trillm.engine.request_inbox import RequestInbox
from trillm.engine.request_stream import ParentRequest, RequestStream
from trillm.engine.stream_pacing import DEFAULT_WAKE_BUDGET
from trillm.errors import EngineDeadError
from trillm.lora.checker import LoRAChecker
from trillm.lora.request import LoRARequest
from trillm.messages import (
    AbortRequest,
    OutputHandlerInput,
    SchedulerStats,
)
from trillm.outputs import ClassificationOutput, ClassificationRequestOutput, PoolingRequestOutput
from trillm.sampling_params import SamplingParams
from trillm.utils import unwrap_group

if TYPE_CHECKING:
    from trillm.executor.abstract import Executor
    from trillm.tokenizer_protocol import Tokenizer

logger = logging.getLogger(__name__)

_INBOX_SIZE = 8  # messages in flight to the output handler (engine steps, requests, aborts)


class AsyncEngine(EngineControl):
    """Handle to a running engine; get one from ``engine_startup.open_engine``. Sleep mode,
    pause and ``collective_rpc``: ``engine_control.py``."""

    def __init__(
        self,
        config: TrillmConfig,
        tokenizer: Tokenizer,
        executor: Executor | list[Executor],  # one per engine core (data parallelism)
        stream_interval: int = 1,
        stream_wake_budget: int | None = DEFAULT_WAKE_BUDGET,
        chat_template: str | None = None,
    ) -> None:
        self.config = config
        self.model_config = config.model
        self.tokenizer = tokenizer
        self.executors = list(executor) if isinstance(executor, list) else [executor]
        # The engine cores, their inputs, stats and router (``engine_cores.py``).
        self.engine_cores = EngineCores(
            config, self.executors, structured_output_manager(config, tokenizer)
        )
        self.structured_output = self.engine_cores.structured_output
        self.cores = self.engine_cores.cores
        self.router = self.engine_cores.router
        # Stage 2 (render, tokenize, truncate, validate), shared with the HTTP layer.
        self.preprocessor = Preprocessor(config, tokenizer, self.num_blocks, chat_template)
        self.output_processor = OutputProcessor(
            tokenizer, stream_interval=stream_interval, wake_budget=stream_wake_budget
        )
        # Engine outputs, new requests and aborts, in order, to the output handler. Bounded:
        # the engine cores wait when the handler is _INBOX_SIZE messages behind, and so do
        # callers submitting requests.
        self._inbox_send, self._inbox_recv = trio.open_memory_channel[OutputHandlerInput](
            _INBOX_SIZE
        )
        # Adapters checked against the model (trillm/lora/checker.py), with --enable-lora.
        self.lora_checker = None if config.lora is None else LoRAChecker(config)
        # What each request submits through (request_inbox.py).
        self.inbox = RequestInbox(
            self._inbox_send,
            self.preprocessor,
            stream_interval,
            self.lora_checker,
            self.structured_output,
        )
        self.stream_interval = stream_interval
        # Called with each step's computed-token count and its engine core's index (the
        # metrics' iteration_tokens_total).
        self.step_observers: list[Callable[[int, int], None]] = []
        self._ids = itertools.count()
        self.died = trio.Event()  # set with dead_error (the server exits on it)
        self.is_running = False

    # ------------------------------------------------------------------ status
    @property
    def dead_error(self) -> EngineDeadError | None:
        """What the engine died of (None while it runs)."""
        return self.inbox.dead_error

    @property
    def is_dead(self) -> bool:
        return self.dead_error is not None

    @property
    def num_blocks(self) -> int:
        """KV blocks of one engine core (the smallest: a request must fit any core)."""
        return self.engine_cores.num_blocks

    @property
    def data_parallel_size(self) -> int:
        return len(self.cores)

    def longest_running_step(self) -> tuple[float, int]:
        """(seconds, engine core) of the step that has run longest now: a worker stopped or
        hung mid-step shows here long before the executor's step timeout ends it."""
        return self.engine_cores.longest_running_step()

    def get_stats(self) -> SchedulerStats:
        """The scheduler stats, summed over the engine cores (KV usage: their mean)."""
        return self.engine_cores.summed_stats()

    def get_engine_stats(self) -> list[SchedulerStats]:
        """Each engine core's last scheduler stats, by core index."""
        return list(self.engine_cores.stats)

    def engine_index_of(self, request_id: str) -> int | None:
        """The engine core running a request now (None once it is over, or never known)."""
        return self.engine_cores.index_of(self.output_processor.child_ids(request_id))

    # ------------------------------------------------------------------ tasks
    async def run_core(self, *, task_status: trio.TaskStatus = trio.TASK_STATUS_IGNORED) -> None:
        send_outputs = self._inbox_send.clone()  # the engine core's outputs share the inbox
        try:
            async with trio.open_nursery() as nursery:
                handler = OutputHandler(
                    self.output_processor,
                    self.engine_cores,
                    self.step_observers,
                    self._die,
                    lambda: self.dead_error,
                )
                await nursery.start(handler.run, self._inbox_recv)
                await self.engine_cores.start(nursery, send_outputs, self._die)
                await send_outputs.aclose()
                self.is_running = True
                task_status.started()
        except Exception as exc:  # the engine is gone: fail everything, keep the process up
            self._die(exc)
        finally:
            self.is_running = False

    def _die(self, exc: BaseException) -> None:
        if self.dead_error is not None:
            return
        exc = unwrap_group(exc)
        if isinstance(exc, EngineDeadError):
            error = exc
        else:
            logger.exception("engine core failed", exc_info=exc)
            error = EngineDeadError(f"The engine core failed: {type(exc).__name__}: {exc}")
            error.__cause__ = exc
        self.inbox.dead_error = error
        self.died.set()

    # ------------------------------------------------------------------ requests
    def token_text(self, token_id: int) -> str | None:
        """``decode([token_id])``, from the cache the logprob entries' texts come from (None
        under --skip-tokenizer-init)."""
        return self.output_processor.token_texts(token_id)

    @property
    def chat_template(self) -> str | None:
        """``--chat-template`` (loaded text), None when the tokenizer's is used."""
        return self.preprocessor.chat_template

    def generate(
        self,
        prompt: PromptType | PreparedPrompt,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        *,
        priority: int = 0,
        cache_salt: str | None = None,
        timeout: float | None = None,  # noqa: ASYNC109 - the request's deadline, not this call's
        lora_request: LoRARequest | None = None,
        _pooling: bool = False,  # ``encode``'s request: the prompt's pooled vector
    ) -> RequestStream:
        """One request: ``async with engine.generate(...) as outputs: async for out in outputs``.

        ``prompt``: a string, a dict (``prompt_token_ids`` / ``prompt``), or a
        ``PreparedPrompt`` from ``self.preprocessor`` (the HTTP layer's: already checked, so
        ``params``, ``priority`` and ``cache_salt`` come from it and nothing is checked again).
        ``timeout``: seconds after which the request is aborted and its last output carries
        ``finish_reason == "timeout"`` (what it produced until then is kept).
        ``lora_request``: the adapter to run with (needs ``enable_lora``). Leaving the block
        before the final output aborts the request (``request_stream.py``)."""
        if not _pooling:
            self._refuse_pooling()
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        return RequestStream(
            self.inbox,
            prompt,
            params,
            request_id,
            priority=priority,
            cache_salt=cache_salt,
            timeout=timeout,
            lora_request=lora_request,
        )

    def generate_many(
        self,
        prompts: Sequence[PromptType | PreparedPrompt],
        params: SamplingParams | Sequence[SamplingParams | None] | None = None,
        request_ids: Sequence[str] | None = None,
        *,
        priority: int = 0,
        cache_salt: str | None = None,
        timeout: float | None = None,  # noqa: ASYNC109 - the request's deadline, not this call's
        lora_requests: Sequence[LoRARequest | None] | None = None,
        max_in_flight: int | None = None,
        may_start: Callable[[], bool] | None = None,
    ) -> ParentRequest:
        """Several prompts as one request: ``async with engine.generate_many(prompts, params)
        as items: async for index, out in items`` (``out``: a ``RequestOutput``, or the
        exception that ended that prompt alone). ``params``: one, or one per prompt;
        ``request_ids``: one per prompt (default ``<id>-<index>``); ``timeout``: the whole
        request's deadline; ``max_in_flight``: prompts in the engine at once at most, the next
        submitted as one ends, while ``may_start()`` says so."""
        self._refuse_pooling()
        n = len(prompts)
        if params is None or isinstance(params, SamplingParams):
            params_list: list[SamplingParams | None] = [params] * n
        else:
            params_list = list(params)
        if request_ids is None:
            base = f"req-{next(self._ids)}"
            request_ids = [f"{base}-{i}" for i in range(n)]
        return ParentRequest(
            self.inbox,
            prompts,
            params_list,
            request_ids,
            priority=priority,
            cache_salt=cache_salt,
            timeout=timeout,
            lora_requests=lora_requests,
            max_in_flight=max_in_flight,
            may_start=may_start,
        )

    def _refuse_pooling(self) -> None:
        if self.is_pooling:
            raise InvalidRequestError(
                "This is a pooling model (runner='pooling'): it embeds prompts "
                "(encode / LLM.embed / /v1/embeddings) and does not generate text.",
                "model",
            )

    @property
    def is_pooling(self) -> bool:
        return self.config.pooler is not None

    async def encode(
        self,
        prompt: PromptType | PreparedPrompt,
        request_id: str | None = None,
        *,
        truncate_prompt_tokens: int | None = None,
        priority: int = 0,
    ) -> PoolingRequestOutput:
        """A pooling model's vector of one prompt (vLLM's ``encode`` / ``embed``).

        ``prompt``: as for ``generate``, or a ``PreparedPrompt`` built with
        ``outputs.pooling_params`` (the HTTP layer's)."""
        return await pool(self, prompt, request_id, truncate_prompt_tokens, priority, "embed")

    async def classify(
        self,
        prompt: PromptType | PreparedPrompt,
        request_id: str | None = None,
        *,
        truncate_prompt_tokens: int | None = None,
        priority: int = 0,
    ) -> ClassificationRequestOutput:
        """A sequence classifier's class probabilities for one prompt (vLLM's ``classify``)."""
        out = await pool(self, prompt, request_id, truncate_prompt_tokens, priority, "classify")
        return ClassificationRequestOutput(
            out.request_id,
            out.prompt_token_ids,
            ClassificationOutput(out.outputs.embedding),
            metrics=out.metrics,
        )

    async def check_lora(self, lora: LoRARequest) -> None:
        """InvalidRequestError (a 400) unless LoRA is on and the adapter fits the model."""
        await self.inbox.check_lora(lora)

    def chat(
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
        mm_processor_kwargs: dict[str, Any] | None = None,
        chat_template_content_format: str | None = None,
        **kwargs: Any,
    ) -> RequestStream:
        """``async with engine.chat(messages, params) as outputs`` (the chat rendered now)."""
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
            mm_processor_kwargs=mm_processor_kwargs,
            chat_template_content_format=chat_template_content_format,
        )
        return self.generate(prompt, params, request_id, **kwargs)

    def render_chat(self, messages: list[dict[str, Any]], **options: Any) -> dict[str, Any]:
        """The chat as a prompt for ``generate``; ``chat_template``: a path or the text.
        ``image_url`` / ``image_pil`` / ``video_url`` parts become the model's placeholder and
        the prompt's ``multi_modal_data`` (URLs opened by ``generate``, off the event loop);
        ``mm_processor_kwargs`` goes with them (vLLM's)."""
        template = load_chat_template(options.pop("chat_template", None))
        mm_kwargs = options.pop("mm_processor_kwargs", None)
        images: list[Any] = []
        if self.preprocessor.multimodal is not None:  # (else stage 2 refuses image parts)
            video = getattr(self.preprocessor.multimodal, "video_placeholder", None)
            messages, images = split_chat_images(messages, video)
        text = self.preprocessor.render_chat(messages, chat_template=template, **options)
        prompt: dict[str, Any] = {"prompt": text, "add_special_tokens": False}
        if images:
            prompt["multi_modal_data"] = multi_modal_data(images)
        if mm_kwargs is not None:
            prompt["mm_processor_kwargs"] = mm_kwargs
        return prompt

    async def abort(self, request_id: str) -> None:
        """Abort a request by id; its reader gets the final 'abort' output."""
        await self.inbox.send_abort(AbortRequest(request_id))
