"""What a caller of the engine receives: ``RequestOutput`` with one ``CompletionOutput`` per
sample, shaped like vLLM's so code written against vLLM reads the same fields.

``logprobs`` is a list with one entry per generated position: ``dict[token_id, Logprob]``
holding the sampled token and the top-k alternatives. ``prompt_logprobs`` has one entry per
prompt position, the first being ``None`` (nothing predicts the first token).

``RequestOutput.add`` merges a later output into an earlier one; the per-request collector
uses it when the reader falls behind (``aggregate=True`` for DELTA outputs concatenates,
``aggregate=False`` for CUMULATIVE replaces).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

SampleLogprobs = list[dict[int, "Logprob"]]  # [num_positions] {token_id: Logprob}
PromptLogprobs = list["dict[int, Logprob] | None"]  # [num_prompt_tokens], first is None


@dataclass(slots=True)
class Logprob:
    logprob: float
    rank: int | None = None  # 1 = the most likely token
    decoded_token: str | None = None


@dataclass(slots=True)
class RequestMetrics:
    """Wall-clock times (``time.time()``) of one request's milestones on the output side."""

    arrival_time: float
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_generation_tokens: int = 0
    first_scheduled_time: float | None = None  # the engine's first P1 for this request
    engine_index: int = 0  # the engine core that runs it (data parallelism)
    # --collect-detailed-traces, a pooling request's (vLLM V0's names; seconds summed over its
    # steps); a generated sample's are on its CompletionOutput.
    model_forward_time: float | None = None
    model_execute_time: float | None = None


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: SampleLogprobs | None
    finish_reason: str | None = None  # 'stop' | 'length' | 'abort' | None while running
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    # Filled by ``LLM.chat`` when given a tool_parser / reasoning_parser (issue 12): the
    # calls in OpenAI's shape, the text without them, the <think> section.
    tool_calls: list[dict] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    # --collect-detailed-traces, on a finished sample: its seconds in the model's forward /
    # the worker's execute call, summed over the steps that ran it (vLLM V0's RequestMetrics
    # model_forward_time / model_execute_time, per engine request as its spans); else None.
    model_forward_time: float | None = None
    model_execute_time: float | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None

    def merge(self, later: CompletionOutput, aggregate: bool) -> None:
        """Fold ``later`` (the same sample, a later step) into this one."""
        if aggregate:
            self.text += later.text
            self.token_ids.extend(later.token_ids)
            if later.logprobs is not None:
                if self.logprobs is None:
                    self.logprobs = []
                self.logprobs.extend(later.logprobs)
        else:
            self.text = later.text
            self.token_ids = later.token_ids
            self.logprobs = later.logprobs
        self.cumulative_logprob = later.cumulative_logprob
        self.finish_reason = later.finish_reason
        self.stop_reason = later.stop_reason
        self.model_forward_time = later.model_forward_time
        self.model_execute_time = later.model_execute_time


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int] | None
    prompt_logprobs: PromptLogprobs | None
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None
    # prompt tokens computed and written to the prefix cache (vLLM's num_cache_creation_tokens)
    num_cache_creation_tokens: int = 0
    kv_transfer_params: dict | None = field(default=None, repr=False)  # vLLM field, unused
    # A pooling model's vector (float32 bytes; ``PoolingRequestOutput`` holds it as floats).
    pooled: bytes | None = field(default=None, repr=False)

    def add(self, later: RequestOutput, aggregate: bool) -> None:
        """Merge ``later`` into this pending output (the reader has not taken it yet).

        ``aggregate`` (DELTA): text, token ids and logprobs are concatenated per sample index;
        otherwise (CUMULATIVE) each sample in ``later`` replaces the one with its index. Samples
        only in ``later`` (another child of an n>1 request) are appended.
        """
        by_index = {c.index: c for c in self.outputs}
        for completion in later.outputs:
            mine = by_index.get(completion.index)
            if mine is None:
                self.outputs.append(completion)
                by_index[completion.index] = completion
            else:
                mine.merge(completion, aggregate)
        self.outputs.sort(key=lambda c: c.index)
        self._merge_prompt_logprobs(later, aggregate)
        self.finished = later.finished
        self.num_cached_tokens = later.num_cached_tokens
        self.num_cache_creation_tokens = later.num_cache_creation_tokens
        if later.metrics is not None:
            self.metrics = later.metrics

    def _merge_prompt_logprobs(self, later: RequestOutput, aggregate: bool) -> None:
        if later.prompt_logprobs is None:
            return
        if aggregate and self.prompt_logprobs is not None:
            self.prompt_logprobs = self.prompt_logprobs + later.prompt_logprobs
        else:
            self.prompt_logprobs = later.prompt_logprobs


@dataclass(slots=True)
class BeamSearchSequence:
    """One beam of ``LLM.beam_search`` (vLLM's shape): ``tokens`` is the prompt and the
    output, ``logprobs`` one entry per output token (the top candidates it was chosen
    among), ``cum_logprob`` the output's summed logprob (before any length penalty)."""

    tokens: list[int]
    logprobs: SampleLogprobs
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None  # 'stop' (EOS or a stop string) | 'length' | 'abort'
    stop_reason: int | str | None = None  # the EOS id or stop string that ended it


@dataclass(slots=True)
class BeamSearchOutput:
    """A prompt's beams, best first (by length-penalized score)."""

    sequences: list[BeamSearchSequence]


# ---------------------------------------------------------------- pooling models


@dataclass(slots=True)
class EmbeddingOutput:
    embedding: list[float]  # [hidden_size], normalized when the model's pooler says so

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass(slots=True)
class PoolingRequestOutput:
    """A pooling model's answer to one prompt (vLLM's ``EmbeddingRequestOutput`` shape)."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput
    finished: bool = True
    metrics: RequestMetrics | None = None  # the engine's times of it (/metrics, traces)


@dataclass(slots=True)
class ClassificationOutput:
    probs: list[float]  # [num_labels]: softmax of the score head's logits (sigmoid for one)

    @property
    def num_classes(self) -> int:
        return len(self.probs)


@dataclass(slots=True)
class ClassificationRequestOutput:
    """A classifier's answer to one prompt (vLLM's ``ClassificationRequestOutput`` shape)."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: ClassificationOutput
    finished: bool = True
    metrics: RequestMetrics | None = None  # the engine's times of it (/metrics, traces)


@dataclass(slots=True)
class ScoringOutput:
    score: float  # a cross-encoder's score, or the cosine similarity of two embeddings


@dataclass(slots=True)
class ScoringRequestOutput:
    """One text pair's score (vLLM's ``ScoringRequestOutput`` shape): ``prompt_token_ids``
    is the pair's prompt (a cross-encoder), or both texts' ids one after the other."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: ScoringOutput
    finished: bool = True


def pooling_params(truncate_prompt_tokens: int | None = None) -> Any:
    """The SamplingParams a pooling request travels with: the prompt's one step, then done
    (the runner returns one placeholder token with the vector; it is never detokenized)."""
    from trillm.sampling_params import SamplingParams

    return SamplingParams(
        max_tokens=1,
        temperature=0.0,
        detokenize=False,
        truncate_prompt_tokens=truncate_prompt_tokens,
    )
