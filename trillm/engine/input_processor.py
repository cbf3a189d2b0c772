"""Stage 2/4: turn a user prompt and SamplingParams into an EngineCoreRequest.

Tokenizes string prompts, checks token-id prompts, applies the model's limits (context length,
vocabulary, logprob cap) and fills the tokenizer-derived sampling fields (bad-word token ids,
stop ids that ``min_tokens`` suppresses).
"""

from __future__ import annotations

import time
from typing import Any

from trillm.config import ModelConfig
from trillm.messages import EngineCoreRequest
from trillm.sampling_params import SamplingParams

PromptType = str | dict[str, Any]


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


class InputProcessor:
    def __init__(self, model_config: ModelConfig, tokenizer: Any, max_logprobs: int) -> None:
        self.model_config = model_config
        self.tokenizer = tokenizer
        self.max_logprobs = max_logprobs
        self.vocab_size = model_config.vocab_size
        eos = getattr(tokenizer, "eos_token_id", None)
        eos_ids = list(model_config.eos_token_ids)
        self.eos_token_id: int | None = (
            eos if eos is not None else (eos_ids[0] if eos_ids else None)
        )
        # Further EOS ids from generation_config stop generation like stop_token_ids do.
        self.extra_eos_ids = [t for t in eos_ids if t != self.eos_token_id]

    def prompt_token_ids(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, list(self.tokenizer.encode(prompt))
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            ids = prompt["prompt_token_ids"]
            if not isinstance(ids, list) or not all(
                isinstance(t, int) and not isinstance(t, bool) for t in ids
            ):
                raise InvalidRequestError("prompt_token_ids must be a list of integers.", "prompt")
            bad = [t for t in ids if not 0 <= t < self.vocab_size]
            if bad:
                raise InvalidRequestError(
                    f"Token id {bad[0]} is out of vocabulary (vocab size {self.vocab_size}).",
                    "prompt",
                )
            return prompt.get("prompt"), list(ids)
        if isinstance(prompt, dict) and isinstance(prompt.get("prompt"), str):
            # A rendered chat already holds its special tokens: add_special_tokens=False.
            add_special = bool(prompt.get("add_special_tokens", True))
            text = prompt["prompt"]
            return text, list(self.tokenizer.encode(text, add_special_tokens=add_special))
        raise InvalidRequestError(
            "A prompt is a string, or a dict with 'prompt_token_ids' (or 'prompt').", "prompt"
        )

    def process(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams,
        priority: int = 0,
        cache_salt: str | None = None,
    ) -> tuple[str | None, EngineCoreRequest]:
        text, ids = self.prompt_token_ids(prompt)
        if params.truncate_prompt_tokens is not None:
            ids = truncate_prompt(
                ids, params.truncate_prompt_tokens, self.model_config.max_model_len
            )
            text = None  # the text no longer matches the ids
        if not ids:
            raise InvalidRequestError("The prompt cannot be empty.", "prompt")
        params = params.clone()
        params.verify_vocab(self.vocab_size, self.max_logprobs)
        self._apply_length_limit(ids, params)
        self._apply_stop_ids(params)
        if params.bad_words:
            params.bad_words_token_ids = self._bad_words_token_ids(params.bad_words)
        request = EngineCoreRequest(
            request_id=request_id,
            prompt_token_ids=ids,
            sampling_params=params,
            arrival_time=time.monotonic(),
            eos_token_id=self.eos_token_id,
            priority=priority,
            cache_salt=cache_salt,
        )
        return text, request

    def _apply_length_limit(self, ids: list[int], params: SamplingParams) -> None:
        max_len = self.model_config.max_model_len
        if len(ids) >= max_len:
            raise InvalidRequestError(
                f"This model's maximum context length is {max_len} tokens. However, your "
                f"prompt has {len(ids)} tokens, leaving no room for any output.",
                "prompt",
            )
        if params.max_tokens is None:
            params.max_tokens = max_len - len(ids)
        elif len(ids) + params.max_tokens > max_len:
            raise InvalidRequestError(
                f"This model's maximum context length is {max_len} tokens. However, you "
                f"requested {len(ids) + params.max_tokens} tokens ({len(ids)} in the prompt, "
                f"{params.max_tokens} for the completion). Please reduce the prompt or "
                "max_tokens.",
                "max_tokens",
            )

    def _apply_stop_ids(self, params: SamplingParams) -> None:
        stop_ids = list(params.stop_token_ids or [])
        if not params.ignore_eos:
            stop_ids += [t for t in self.extra_eos_ids if t not in stop_ids]
        params.stop_token_ids = stop_ids
        eos = [self.eos_token_id] if self.eos_token_id is not None else []
        params.all_stop_token_ids = sorted(set(stop_ids + eos))

    def _bad_words_token_ids(self, words: list[str]) -> list[list[int]]:
        out: list[list[int]] = []
        for word in words:
            # A word can appear at the start of the text or after a space: ban both spellings.
            for variant in (word, " " + word.lstrip()):
                ids = list(self.tokenizer.encode(variant, add_special_tokens=False))
                if ids and ids not in out:
                    out.append(ids)
        return out
