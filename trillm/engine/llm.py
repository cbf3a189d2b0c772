"""The blocking API: ``LLM(model).generate(prompts, params)`` for scripts.

An ``LLM`` runs the Trio engine (``open_engine``) on a thread of its own for its whole life
(``engine_thread.py``); each ``generate`` call hands a batch to that thread and blocks until
every request finished, returning outputs in input order (with a tqdm progress bar).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import trio

from trillm.config.batch_defaults import UsageContext
from trillm.engine.async_engine import AsyncEngine
from trillm.engine.beam_request import BeamSearchRequest
from trillm.engine.engine_thread import EngineThread
from trillm.engine.llm_control import LLMControl
from trillm.engine.preprocess import PreparedPrompt, PromptType
from trillm.lora.request import LoRARequest
from trillm.outputs import (
    BeamSearchOutput,
    ClassificationRequestOutput,
    PoolingRequestOutput,
    RequestOutput,
    ScoringRequestOutput,
)
from trillm.sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams
from trillm.utils import first_leaf

if TYPE_CHECKING:
    from trillm.tokenizer_protocol import Tokenizer

T = TypeVar("T")


class LLM(LLMControl):
    """Sleep mode and collective_rpc: ``llm_control.py``."""

    def __init__(self, model: str | None = None, **engine_args: Any) -> None:
        # vLLM's LLM class defaults (a larger step budget: config/batch_defaults.py)
        self._thread = EngineThread(model, engine_args, "trillm-engine", UsageContext.LLM_CLASS)

    # ------------------------------------------------------------------ public API
    @property
    def engine(self) -> AsyncEngine:
        return self._thread.engine

    def get_tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """``lora_request``: one adapter for every prompt, or one (or None) per prompt."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        prompts = list(prompts)
        params_list = self._params_list(sampling_params, len(prompts))
        loras = self._lora_list(lora_request, len(prompts))
        return self._call(self._generate_all, prompts, params_list, use_tqdm, loras)

    def beam_search(
        self,
        prompts: PromptType | Sequence[PromptType],
        params: BeamSearchParams,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        use_tqdm: bool = False,
    ) -> list[BeamSearchOutput]:
        """vLLM's ``LLM.beam_search``: per prompt its ``beam_width`` beams, best first, each
        with ``tokens`` (prompt and output), ``text`` (the prompt's and the output's),
        ``cum_logprob`` and per output token its candidates' ``logprobs``; searched as
        transformers' ``generate(num_beams=..., do_sample=False)`` (``beam_request.py``).
        ``use_tqdm``: a bar of search steps (the prompts advance together)."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        prompts = list(prompts)
        loras = self._lora_list(lora_request, len(prompts))
        return self._call(self._beam_search_all, prompts, params, loras, use_tqdm)

    async def _beam_search_all(
        self,
        prompts: list[PromptType],
        params: BeamSearchParams,
        loras: list[LoRARequest | None],
        use_tqdm: bool,
    ) -> list[BeamSearchOutput]:
        from tqdm.auto import tqdm

        # Checked as n = beam_width sequences of max_tokens each: what the search can hold.
        whole = SamplingParams(n=params.beam_width, max_tokens=params.max_tokens, temperature=0)
        prepared = [await self.engine.preprocessor.prepare(p, whole) for p in prompts]
        ids = [f"beam-{id(prepared)}-{i}" for i in range(len(prompts))]
        request = BeamSearchRequest(
            self.engine, prepared, params, ids, lora_requests=loras, keep_logprobs=True
        )
        with tqdm(total=params.max_tokens, desc="Beam search", disable=not use_tqdm) as bar:
            await request.run(on_step=lambda: bar.update(1))
        return request.outputs()

    def embed(
        self,
        prompts: PromptType | Sequence[PromptType],
        *,
        truncate_prompt_tokens: int | None = None,
        use_tqdm: bool = True,
    ) -> list[PoolingRequestOutput]:
        """A pooling model's vector per prompt (``outputs.embedding``), in order; needs
        ``runner="pooling"`` (or ``convert="embed"``)."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        return self._call(self._embed_all, list(prompts), truncate_prompt_tokens, use_tqdm)

    def classify(
        self,
        prompts: PromptType | Sequence[PromptType],
        *,
        truncate_prompt_tokens: int | None = None,
        use_tqdm: bool = True,
    ) -> list[ClassificationRequestOutput]:
        """A sequence classifier's class probabilities per prompt (``outputs.probs``), in
        order; needs a ``*ForSequenceClassification`` checkpoint."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        return self._call(
            self._embed_all, list(prompts), truncate_prompt_tokens, use_tqdm, "classify"
        )

    def score(
        self,
        text_1: str | Sequence[str],
        text_2: str | Sequence[str],
        *,
        truncate_prompt_tokens: int | None = None,
        use_tqdm: bool = True,
    ) -> list[ScoringRequestOutput]:
        """Each pair's score (``outputs.score``; 1:1, 1:N or N:N, ``engine/scoring.py``): a
        cross-encoder's, or the cosine similarity of an embedding model's vectors."""
        firsts = [text_1] if isinstance(text_1, str) else list(text_1)
        seconds = [text_2] if isinstance(text_2, str) else list(text_2)
        return self._call(self._score_all, firsts, seconds, truncate_prompt_tokens, use_tqdm)

    async def _score_all(
        self, texts_1: list[str], texts_2: list[str], truncate: int | None, use_tqdm: bool
    ) -> list[ScoringRequestOutput]:
        from tqdm.auto import tqdm

        from trillm.engine.scoring import score_pairs

        engine = self.engine

        async def run(prepared: list[PreparedPrompt], task: str) -> list[Any]:
            call = engine.classify if task == "classify" else engine.encode
            results: list[Any] = [None] * len(prepared)
            bar = tqdm(total=len(prepared), desc="Scored prompts", disable=not use_tqdm)

            async def one(i: int) -> None:
                results[i] = await call(prepared[i])
                bar.update(1)

            try:
                async with trio.open_nursery() as nursery:
                    for i in range(len(prepared)):
                        nursery.start_soon(one, i)
            except ExceptionGroup as group:
                raise first_leaf(group) from group
            finally:
                bar.close()
            return results

        pre = engine.preprocessor
        outs, _ = await score_pairs(engine.config, pre, texts_1, texts_2, truncate, run)
        return outs

    async def _embed_all(
        self,
        prompts: list[PromptType],
        truncate: int | None,
        use_tqdm: bool,
        task: str = "embed",
    ) -> list[Any]:  # PoolingRequestOutput (embed) or ClassificationRequestOutput (classify)
        from tqdm.auto import tqdm

        results: list[Any] = [None] * len(prompts)
        desc = "Classified prompts" if task == "classify" else "Embedded prompts"
        bar = tqdm(total=len(prompts), desc=desc, disable=not use_tqdm)
        call = self.engine.classify if task == "classify" else self.engine.encode

        async def one(i: int, prompt: PromptType) -> None:
            results[i] = await call(
                prompt, f"{task}-{id(results)}-{i}", truncate_prompt_tokens=truncate
            )
            bar.update(1)

        try:
            async with trio.open_nursery() as nursery:
                for i, prompt in enumerate(prompts):
                    nursery.start_soon(one, i, prompt)
        except ExceptionGroup as group:
            raise first_leaf(group) from group
        finally:
            bar.close()
        return [r for r in results if r is not None]

    def chat(
        self,
        messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        *,
        tools: list[dict[str, Any]] | None = None,
        tool_parser: str | None = None,
        reasoning_parser: str | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        **chat_options: Any,
    ) -> list[RequestOutput]:
        """Render each conversation with the chat template (``tools``, OpenAI's tool dicts,
        reach it too) and generate. With ``tool_parser`` (``hermes``, ``llama3_json``,
        ``mistral``, ``pythonic`` or a registered one) each CompletionOutput also carries
        ``tool_calls`` (OpenAI's shape, ``[]`` when none) and ``content`` (the text without
        the calls); with ``reasoning_parser`` (``deepseek_r1``, ``qwen3``; default: the
        engine's),
        ``reasoning_content`` and ``content`` without it. ``text`` stays the raw output.
        ``chat_options``: vLLM's ``chat_template``, ``chat_template_content_format`` (default:
        the engine's), ``add_generation_prompt``, ``continue_final_message``,
        ``chat_template_kwargs``, ``documents``, ``mm_processor_kwargs``."""
        from trillm.parsers.reasoning import get_reasoning_parser
        from trillm.parsers.special_tokens import markers_are_special
        from trillm.parsers.tool_parsers import get_tool_parser

        tool_cls = get_tool_parser(tool_parser) if tool_parser else None  # ValueError if unknown
        # The engine's reasoning parser (it also holds grammars back until reasoning ends).
        reasoning_parser = reasoning_parser or self.engine.config.reasoning_parser
        reasoning_cls = get_reasoning_parser(reasoning_parser) if reasoning_parser else None
        conversations: list[list[dict[str, Any]]] = (
            messages if messages and isinstance(messages[0], list) else [messages]  # type: ignore[assignment,list-item]
        )
        rendered = [
            self.engine.render_chat(conv, tools=tools, **dict(chat_options))
            for conv in conversations
        ]
        prompts: list[PromptType] = list(rendered)
        markers = tool_cls.markers if tool_cls is not None else ()
        params_list = self._params_list(sampling_params, len(prompts))
        if markers_are_special(self.get_tokenizer(), markers, reasoning_cls is not None):
            params_list = [p.clone() for p in params_list]
            for p in params_list:
                p.skip_special_tokens = False  # the parsers' markers are special tokens
        outputs = self.generate(prompts, params_list, use_tqdm, lora_request)
        tags_are_tokens = reasoning_cls is None or reasoning_cls.tags_are_tokens_of(
            self.get_tokenizer()
        )
        for prompt, out in zip(rendered, outputs, strict=True):
            for c in out.outputs:
                content: str | None = c.text
                if reasoning_cls is not None:
                    parser = reasoning_cls(
                        prompt["prompt"], chat_options.get("chat_template_kwargs")
                    )
                    parser.tags_are_tokens = tags_are_tokens
                    c.reasoning_content, content = parser.extract(c.text)
                if tool_cls is not None:
                    extracted = tool_cls(tools).extract(content or "")
                    c.tool_calls = [call.to_dict() for call in extracted.tool_calls]
                    if extracted.tools_called:
                        content = extracted.content
                c.content = content
        return outputs

    def shutdown(self) -> None:
        self._thread.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # ------------------------------------------------------------------ internals
    def _call(self, fn: Callable[..., Awaitable[T]], *args: Any) -> T:
        return self._thread.call(fn, *args)

    @staticmethod
    def _params_list(
        params: SamplingParams | Sequence[SamplingParams] | None, n: int
    ) -> list[SamplingParams]:
        if params is None:
            params = SamplingParams()
        if isinstance(params, SamplingParams):
            params_list = [params] * n
        else:
            params_list = list(params)
            if len(params_list) != n:
                raise ValueError(
                    f"Got {len(params_list)} sampling params for {n} prompts; pass one, or "
                    "one per prompt."
                )
        out = []
        for p in params_list:
            p = p.clone()
            p.output_kind = RequestOutputKind.FINAL_ONLY  # only the end result is wanted
            out.append(p)
        return out

    @staticmethod
    def _lora_list(
        lora: LoRARequest | Sequence[LoRARequest | None] | None, n: int
    ) -> list[LoRARequest | None]:
        if lora is None or isinstance(lora, LoRARequest):
            return [lora] * n
        loras = list(lora)
        if len(loras) != n:
            raise ValueError(
                f"Got {len(loras)} lora_request for {n} prompts; pass one, or one per prompt."
            )
        return loras

    async def _generate_all(
        self,
        prompts: list[PromptType],
        params_list: list[SamplingParams],
        use_tqdm: bool,
        loras: list[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """The prompts as one parent request (``AsyncEngine.generate_many``); the first
        prompt that fails fails the call."""
        from tqdm.auto import tqdm

        results: list[RequestOutput | None] = [None] * len(prompts)
        bar = tqdm(total=len(prompts), desc="Processed prompts", disable=not use_tqdm)
        ids = [f"llm-{id(results)}-{i}" for i in range(len(prompts))]
        try:
            request = self.engine.generate_many(
                prompts, params_list, ids, lora_requests=loras or None
            )
            async with request as items:
                async for index, out in items:
                    if isinstance(out, Exception):
                        raise out
                    results[index] = out
                    if out.finished:
                        bar.update(1)
        finally:
            bar.close()
        return [r for r in results if r is not None]
