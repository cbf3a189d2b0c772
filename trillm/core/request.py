"""The engine-side state of one request, owned by the scheduler (pure-Python twin).

A request has no prefill/decode phase: it has ``num_computed_tokens`` (tokens whose KV is in
the cache, or scheduled to be) and ``num_tokens`` (prompt + output). The scheduler hands out
``num_tokens_with_spec - num_computed_tokens`` tokens at most per step.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence

from trillm.messages import EngineCoreRequest, FinishReason
from trillm.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2  # back in the waiting queue after its blocks were taken (recompute)
    # In the waiting queue until its structured-output grammar is compiled; the requests
    # behind it are admitted meanwhile.
    WAITING_FOR_GRAMMAR = 3
    # In the waiting queue while a KV connector receives its prompt's KV off the steps
    # (vLLM's asynchronous load); the requests behind it are admitted meanwhile.
    WAITING_FOR_REMOTE_KVS = 4
    FINISHED_STOPPED = 5
    FINISHED_LENGTH_CAPPED = 6
    FINISHED_ABORTED = 7

    @property
    def finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED


_STATUS_OF_REASON = {
    FinishReason.STOP: RequestStatus.FINISHED_STOPPED,
    FinishReason.LENGTH: RequestStatus.FINISHED_LENGTH_CAPPED,
    FinishReason.ABORT: RequestStatus.FINISHED_ABORTED,
}


def finished_status(reason: FinishReason) -> RequestStatus:
    return _STATUS_OF_REASON[FinishReason(reason)]


class Request:
    __slots__ = (
        "request_id",
        "prompt_token_ids",
        "output_token_ids",
        "all_token_ids",
        "spec_token_ids",
        "sampling_params",
        "max_tokens",
        "min_tokens",
        "ignore_eos",
        "stop_token_ids",
        "eos_token_id",
        "priority",
        "arrival_time",
        "status",
        "num_computed_tokens",
        "num_cached_tokens",
        "block_hashes",
        "cache_salt",
        "extra_hash_keys",
        "sent_to_worker",
        "first_output_sent",
        "cache_writes_sent",
        "skip_prefix_lookup",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        sampling_params: SamplingParams,
        arrival_time: float = 0.0,
        eos_token_id: int | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        extra_hash_keys: Sequence[str] = (),
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)  # [num_prompt_tokens]
        self.output_token_ids: list[int] = []  # [num_output_tokens]
        self.all_token_ids = list(self.prompt_token_ids)  # prompt + output
        # Draft tokens to verify next step (speculative decoding seam).
        self.spec_token_ids: list[int] = []
        self.sampling_params = sampling_params
        self.max_tokens = sampling_params.max_tokens  # None: until max_model_len
        self.min_tokens = sampling_params.min_tokens
        self.ignore_eos = sampling_params.ignore_eos
        self.stop_token_ids = list(sampling_params.stop_token_ids or ())
        self.eos_token_id = eos_token_id
        self.priority = priority
        self.arrival_time = arrival_time
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        # Prompt tokens served by the prefix cache at the first schedule; None until then.
        self.num_cached_tokens: int | None = None
        # Chain hashes of the full blocks of all_token_ids, filled lazily by the KV manager.
        self.block_hashes: list[int] = []
        self.cache_salt = cache_salt
        self.extra_hash_keys = list(extra_hash_keys)
        # The worker holds this request's state (so a finish/preemption must tell it).
        self.sent_to_worker = False
        self.first_output_sent = False
        # Its prompt tokens written to the prefix cache were reported (its first token / finish).
        self.cache_writes_sent = False
        # Prompt logprobs need every prompt position computed: no prefix-cache hits.
        self.skip_prefix_lookup = sampling_params.prompt_logprobs is not None

    @classmethod
    def from_engine_core_request(cls, req: EngineCoreRequest) -> Request:
        return cls(
            req.request_id,
            req.prompt_token_ids,
            req.sampling_params,
            req.arrival_time,
            req.eos_token_id,
            req.priority,
            req.cache_salt,
            req.extra_hash_keys,
        )

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_tokens_with_spec(self) -> int:
        return len(self.all_token_ids) + len(self.spec_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.name}, "
            f"computed={self.num_computed_tokens}/{self.num_tokens})"
        )
