"""Stage 2, in one place: render, tokenize, truncate and validate a request, once.

Both front doors go through the engine's ``Preprocessor`` (``AsyncEngine.preprocessor``):

- the Python API: ``AsyncEngine.generate(prompt, params)`` / ``chat(messages, ...)`` call
  ``prepare`` (a string, ``{"prompt": ...}`` or ``{"prompt_token_ids": ...}``);
- the HTTP layer renders (``render_chat``), tokenizes (``tokenize``), builds its
  SamplingParams, then calls ``prepare_ids`` and hands the ``PreparedPrompt`` to
  ``AsyncEngine.generate``, which submits it without checking it again.

What happens here: chat-template rendering (tools, documents, chat_template_kwargs, the
engine's ``--chat-template``); tokenization (a text longer than the context could hold is
refused before any work; short texts inline, long ones in a few threads so the event loop keeps
serving: ``text_tokenizer.py``); ``truncate_prompt_tokens``; token-id, vocabulary, priority,
context-length (one function: ``resolve_max_tokens``) and KV-cache admission checks; the
tokenizer-derived sampling fields (``sampling_fields.py``: stop ids that ``min_tokens``
suppresses, bad-words token ids).
Errors are ``InvalidRequestError`` (a ValueError naming the field; HTTP answers it with a 400),
the KV check's ``RequestTooLargeError``, SamplingParams' ``SamplingParamsError`` and the
template's ``ChatTemplateError``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from trillm.config import TrillmConfig
from trillm.config.logits_processors import load_logits_processors, request_refusal
from trillm.core.errors import RequestTooLargeError
from trillm.engine.chat_template import (
    load_chat_template,
    render_template,
    tokenizer_chat_template,
    tokenizer_special_tokens,
)
from trillm.engine.media import MultiModalInputError
from trillm.engine.multimodal import content_options, processor_for, prompt_ids
from trillm.engine.prompt_embeds import embeds_prompt
from trillm.engine.sampling_fields import apply_stop_ids, bad_words_token_ids, thinking_tags
from trillm.engine.skipped_tokenizer import (
    SkippedTokenizer,
    TokenizerSkipped,
    skipped_tokenizer_params,
)
from trillm.engine.template_budget import RenderBudget
from trillm.engine.text_tokenizer import TokenizeThreads, max_text_chars
from trillm.messages import MultiModalItem
from trillm.model_executor.registry import model_entry
from trillm.sampling_params import INT64_MAX, INT64_MIN, SamplingParams
from trillm.utils import cdiv

if TYPE_CHECKING:
    from trillm.tokenizer_protocol import Tokenizer

PromptType = str | dict[str, Any]

# A request's own chat template (--trust-request-chat-template): its render is stopped after
# this many seconds, or once it has built this many x max_prompt_chars() characters.
REQUEST_TEMPLATE_SECONDS = 5.0
REQUEST_TEMPLATE_CHARS_FACTOR = 4

_EMPTY = {"prompt": "'prompt' must not be empty.", "messages": "The rendered chat is empty."}


class InvalidRequestError(ValueError):
    """The request cannot be served as given; ``param`` names the offending field."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def truncate_prompt(ids: list[int], keep: int | None, max_model_len: int) -> list[int]:
    """``truncate_prompt_tokens``: the last ``keep`` ids (-1: the context length; None: all)."""
    if keep is None:
        return ids
    keep = max_model_len if keep == -1 else keep
    return ids[len(ids) - keep :] if len(ids) > keep else ids


@dataclass(slots=True)
class PreparedPrompt:
    """A prompt that passed every stage-2 check; ``AsyncEngine.generate`` submits it as is.

    ``params`` is the preprocessor's own copy: max_tokens resolved, stop ids and bad-words
    ids filled. ``text`` is the prompt text when it still matches the ids (None otherwise)."""

    prompt_token_ids: list[int]
    params: SamplingParams
    text: str | None = None
    priority: int = 0
    cache_salt: str | None = None
    mm_items: list[MultiModalItem] = field(default_factory=list)  # in prompt order
    # vLLM's per-request stream_interval: a stream's chunks every this many tokens, never
    # fewer than the server's --stream-interval (None: the server's)
    stream_interval: int | None = None


class Preprocessor:
    def __init__(
        self,
        config: TrillmConfig,
        tokenizer: Tokenizer,
        num_blocks: int,
        chat_template: str | None = None,
    ) -> None:
        self.model_config = config.model
        self.tokenizer = tokenizer
        self.tokenizer_skipped = isinstance(tokenizer, SkippedTokenizer)  # --skip-tokenizer-init
        self.max_model_len = config.model.max_model_len
        self.vocab_size = config.model.vocab_size
        self.max_logprobs = config.max_logprobs
        self.block_size = config.cache.block_size
        self.num_blocks = num_blocks
        self.priority_policy = config.scheduler.policy == "priority"
        self.enable_prompt_embeds = config.enable_prompt_embeds  # prompt_embeds.py
        # --chat-template (a path or the text), loaded once; None: the tokenizer's.
        self.chat_template = load_chat_template(chat_template)
        eos = tokenizer.eos_token_id
        eos_ids = list(config.model.eos_token_ids)
        self.eos_token_id: int | None = (
            eos if eos is not None else (eos_ids[0] if eos_ids else None)
        )
        # Further EOS ids from generation_config stop generation like stop_token_ids do.
        self.extra_eos_ids = [t for t in eos_ids if t != self.eos_token_id]
        self.threads = TokenizeThreads()  # long texts tokenized off the event loop
        self.tokenize_limiter = self.threads.limiter  # stage 2's other thread work shares it
        self._max_prompt_chars: int | None = None
        self.multimodal = processor_for(config, tokenizer, self.tokenize_limiter)  # None: text
        self.content_format = config.chat_template_content_format  # auto, string, openai
        self.logits_processors = load_logits_processors(config.logits_processors)
        speculative = config.speculative is not None
        self.thinking_tags = thinking_tags(tokenizer, config.reasoning_parser, speculative)

    # ------------------------------------------------------------------ rendering
    def render_chat(
        self,
        messages: list[Any],
        *,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: dict[str, Any] | None = None,
        tools: list[Any] | None = None,
        documents: list[dict[str, Any]] | None = None,
        budget: RenderBudget | None = None,
        chat_template_content_format: str | None = None,
    ) -> str:
        """The prompt text of a chat. ``chat_template`` is template *text* (a request's, or a
        Python caller's already loaded); default: ``--chat-template``, else the tokenizer's.
        ``budget``: a request's own template is rendered under ``request_template_budget()``.
        ``chat_template_content_format`` (vLLM's ``LLM.chat`` keyword): default the engine's
        ``--chat-template-content-format``. Raises ChatTemplateError."""
        if self.tokenizer_skipped:
            raise TokenizerSkipped("A chat", "messages")
        template = chat_template or self.chat_template or tokenizer_chat_template(self.tokenizer)
        return render_template(
            template,
            messages,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            special_tokens=tokenizer_special_tokens(self.tokenizer),
            template_kwargs=chat_template_kwargs,
            tools=tools,
            documents=documents,
            budget=budget,
            **content_options(chat_template_content_format or self.content_format, self.multimodal),
        )

    def request_template_budget(self) -> RenderBudget:
        """What a request's own chat template may spend: REQUEST_TEMPLATE_SECONDS, and
        REQUEST_TEMPLATE_CHARS_FACTOR x the longest prompt text the context can hold in
        characters built and written (a template touches each message a few times: trim,
        concatenations, the output)."""
        chars = REQUEST_TEMPLATE_CHARS_FACTOR * self.max_prompt_chars()
        return RenderBudget(REQUEST_TEMPLATE_SECONDS, chars)

    # ------------------------------------------------------------------ tokenization
    def max_prompt_chars(self) -> int:
        """The longest text (in characters) that could tokenize to at most max_model_len tokens."""
        if self._max_prompt_chars is None:
            self._max_prompt_chars = max_text_chars(self.tokenizer, self.max_model_len)
        return self._max_prompt_chars

    async def tokenize(
        self,
        text: str,
        add_special_tokens: bool = True,
        *,
        param: str = "prompt",
        truncating: bool = False,
    ) -> list[int]:
        """Token ids of ``text``; a text too long for the context is refused before any work,
        unless the request truncates it (``truncate_prompt_tokens``: the whole text is
        tokenized, as vLLM does, within the bounded tokenization threads)."""
        if self.tokenizer_skipped:
            raise TokenizerSkipped("A text prompt", param)
        limit = self.max_prompt_chars()
        if len(text) > limit and not truncating:
            max_len = self.max_model_len
            raise InvalidRequestError(
                f"This model's maximum context length is {max_len} tokens. However, your prompt "
                f"has {len(text)} characters, more than {max_len} tokens can hold (at most "
                f"{limit} characters for this tokenizer). Please reduce the length of the input.",
                param,
            )
        # NOTE: long prompts off the event loop, so that streams keep flowing
        return await self.threads.encode(self.tokenizer.encode, text, add_special_tokens)

    def check_token_ids(self, ids: list[int], param: str) -> None:
        vocab = self.vocab_size
        for t in ids:
            if not 0 <= t < vocab:
                raise InvalidRequestError(
                    f"Token id {t} in '{param}' is out of vocabulary [0, {vocab}).", param
                )

    async def prompt_token_ids(
        self, prompt: PromptType, truncating: bool = False
    ) -> tuple[str | None, list[int]]:
        """The Python API's prompt forms: a string, ``{"prompt_token_ids": [...]}`` (with an
        optional ``prompt`` text), or ``{"prompt": text, "add_special_tokens": bool}``."""
        if isinstance(prompt, str):
            return prompt, await self.tokenize(prompt, True, truncating=truncating)
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            ids = prompt["prompt_token_ids"]
            if not isinstance(ids, list) or not all(
                isinstance(t, int) and not isinstance(t, bool) for t in ids
            ):
                raise InvalidRequestError("prompt_token_ids must be a list of integers.", "prompt")
            self.check_token_ids(ids, "prompt")
            return prompt.get("prompt"), list(ids)
        if isinstance(prompt, dict) and isinstance(prompt.get("prompt"), str):
            # A rendered chat already holds its special tokens: add_special_tokens=False.
            add_special = bool(prompt.get("add_special_tokens", True))
            text = prompt["prompt"]
            return text, await self.tokenize(text, add_special, truncating=truncating)
        raise InvalidRequestError(
            "A prompt is a string, or a dict with 'prompt_token_ids' (or 'prompt').", "prompt"
        )

    # ------------------------------------------------------------------ validation
    def resolve_max_tokens(
        self,
        prompt_len: int,
        requested: int | None,
        *,
        param: str = "max_tokens",
        prompt_param: str = "prompt",
    ) -> int:
        """THE context-length check: ``requested`` checked against the room the prompt leaves
        in max_model_len, or (None) that room, capped by generation_config's max_new_tokens."""
        max_len = self.max_model_len
        if prompt_len >= max_len:
            raise InvalidRequestError(
                f"This model's maximum context length is {max_len} tokens. However, your request "
                f"has {prompt_len} input tokens, leaving no room for output. Please reduce the "
                "length of the input.",
                prompt_param,
            )
        room = max_len - prompt_len
        if requested is None:
            default = (self.model_config.generation_config or {}).get("max_new_tokens")
            return min(room, default) if isinstance(default, int) and default > 0 else room
        if requested > room:
            raise InvalidRequestError(
                f"This model's maximum context length is {max_len} tokens. However, you "
                f"requested {prompt_len + requested} tokens ({prompt_len} in the input, "
                f"{requested} in the completion). Please reduce the length of the input or "
                f"{param}.",
                param,
            )
        return requested

    def check_kv(self, prompt_len: int, max_tokens: int) -> None:
        """A request that could never fit the whole KV cache is refused before it waits."""
        need = cdiv(prompt_len + max_tokens, self.block_size)
        if need > self.num_blocks:
            raise RequestTooLargeError(
                f"The request needs {need} KV-cache blocks ({prompt_len} prompt tokens + "
                f"{max_tokens} output tokens, block size {self.block_size}) but the cache only "
                f"has {self.num_blocks} blocks."
            )

    def check_priority(self, priority: int) -> None:
        if not isinstance(priority, int) or not INT64_MIN <= priority <= INT64_MAX:
            raise InvalidRequestError(
                f"priority must be a 64-bit integer, got {priority!r}.", "priority"
            )
        if not self.priority_policy and priority != 0:
            raise InvalidRequestError(
                "priority is only supported with --scheduling-policy priority.", "priority"
            )

    # ------------------------------------------------------------------ the whole stage
    async def prepare(
        self,
        prompt: PromptType,
        params: SamplingParams,
        *,
        priority: int = 0,
        cache_salt: str | None = None,
    ) -> PreparedPrompt:
        """The Python API's stage 2: tokenize (long texts off the event loop) and check."""
        self.check_priority(priority)  # (O(1), again in prepare_ids) before any tokenizing
        if isinstance(prompt, dict) and "prompt_embeds" in prompt:  # prompt_embeds.py
            ids, item = embeds_prompt(prompt, params, self.enable_prompt_embeds, self.model_config)
            out = self.prepare_ids(ids, params, priority=priority, cache_salt=cache_salt)
            out.mm_items = [item]
            return out
        truncating = params.truncate_prompt_tokens is not None
        mm_data = prompt.get("multi_modal_data") if isinstance(prompt, dict) else None
        kwargs = prompt.get("mm_processor_kwargs") if isinstance(prompt, dict) else None
        text, ids = await prompt_ids(
            self.multimodal, self.prompt_token_ids, prompt, truncating and mm_data is None
        )
        items: list[MultiModalItem] = []
        if mm_data is not None or kwargs is not None:  # (kwargs alone: their keys checked)
            ids, items = await self.multimodal_ids(ids, mm_data or {}, truncating, kwargs)
        out = self.prepare_ids(ids, params, text=text, priority=priority, cache_salt=cache_salt)
        out.mm_items = items
        return out

    async def multimodal_ids(
        self, ids: list[int], data: object, truncating: bool, kwargs: Any = None
    ) -> tuple[list[int], list[MultiModalItem]]:
        """Stage 3 (``trillm/engine/multimodal.py``): placeholders expanded, items processed."""
        if self.multimodal is None:
            taken = "/".join(model_entry(self.model_config.architecture).modalities)
            why = (
                f"{taken} inputs are off (limit_mm_per_prompt)"
                if self.model_config.mm_config is not None
                else f"{self.model_config.architecture} takes no image (multimodal) inputs"
            )
            raise InvalidRequestError(f"multi_modal_data: {why}.", "multi_modal_data")
        if truncating:
            raise InvalidRequestError(
                "truncate_prompt_tokens with multi_modal_data is not supported yet.",
                "truncate_prompt_tokens",
            )
        try:
            return await self.multimodal.process(ids, data, kwargs)
        except MultiModalInputError as exc:
            raise InvalidRequestError(str(exc), exc.param) from None

    def prepare_ids(
        self,
        ids: list[int],
        params: SamplingParams,
        *,
        text: str | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        prompt_param: str = "prompt",
        max_tokens_param: str = "max_tokens",
    ) -> PreparedPrompt:
        """Token ids (vocabulary already checked) and params -> a PreparedPrompt: truncation,
        the context and KV checks, the tokenizer-derived sampling fields. ``prompt_param`` /
        ``max_tokens_param`` name the fields in errors (a chat names ``messages``)."""
        self.check_priority(priority)
        if params.truncate_prompt_tokens is not None:
            kept = truncate_prompt(ids, params.truncate_prompt_tokens, self.max_model_len)
            if len(kept) != len(ids):
                ids, text = kept, None  # the text no longer matches the ids
        if not ids:
            raise InvalidRequestError(_EMPTY.get(prompt_param, _EMPTY["prompt"]), prompt_param)
        params = params.clone()
        if self.tokenizer_skipped:
            skipped_tokenizer_params(params)
        params.verify_vocab(self.vocab_size, self.max_logprobs)
        if (why := request_refusal(self.logits_processors, params)) is not None:
            raise InvalidRequestError(why)
        max_tokens = self.resolve_max_tokens(
            len(ids), params.max_tokens, param=max_tokens_param, prompt_param=prompt_param
        )
        if params.min_tokens > max_tokens:  # max_tokens may have been resolved just now
            raise InvalidRequestError(
                f"min_tokens must be less than or equal to max_tokens={max_tokens}, got "
                f"{params.min_tokens}.",
                "min_tokens",
            )
        params.max_tokens = max_tokens
        self.check_kv(len(ids), max_tokens)
        apply_stop_ids(params, self.eos_token_id, self.extra_eos_ids)
        if params.bad_words:
            params.bad_words_token_ids = bad_words_token_ids(self.tokenizer, params.bad_words)
        self.thinking_tags.apply(params)
        return PreparedPrompt(list(ids), params, text, priority, cache_salt)
