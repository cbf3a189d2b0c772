"""Admission (stage 4 of a generation route, and the gate's early check): a request's
sequences and tokens reserved in ``ServerState`` before it reaches the engine, 503 past
``--max-num-queued-requests`` / ``--max-num-admitted-tokens``, and released exactly once.

The counts live in ``ServerState`` (``/load``, the drain and shutdown read them); only the
functions here and an ``Admission`` change them.
"""

from __future__ import annotations

from trillm.engine.preprocess import PreparedPrompt
from trillm.entrypoints.openai.endpoints.base import ServerState
from trillm.entrypoints.openai.http.errors import BadRequestError, ServiceUnavailableError


def check_capacity(state: ServerState, seqs: int = 1, tokens: int = 1) -> None:
    """503 (the caller adds Retry-After) when ``seqs`` more sequences or ``tokens`` more
    tokens would overfill the queue: all of a request's prompts and samples are admitted
    together or not at all. (The defaults ask whether any request at all fits.)"""
    limit = state.max_admitted
    if limit is not None and state.admitted + seqs > limit:
        raise ServiceUnavailableError(
            f"The server is overloaded ({state.admitted} sequences running or queued, the "
            f"limit is {limit}); this request needs {seqs}. Retry later."
        )
    token_limit = state.max_admitted_tokens
    if token_limit is not None and tokens > token_limit:
        # Never admitted, however long the client waits: a 400, not a 503 to retry.
        raise BadRequestError(
            f"This request needs {tokens} tokens (prompt tokens plus max_tokens, for each "
            f"prompt and sample), more than this server admits at once ({token_limit}, "
            "--max-num-admitted-tokens). Lower max_tokens or n, or send fewer prompts.",
            "max_tokens",
        )
    if token_limit is not None and state.admitted_tokens + tokens > token_limit:
        raise ServiceUnavailableError(
            f"The server is overloaded ({state.admitted_tokens} tokens running or queued, "
            f"the limit is {token_limit}); this request needs {tokens} (prompt tokens plus "
            "max_tokens, for each prompt and sample). Retry later."
        )


def admit(
    state: ServerState, request_ids: list[str], seqs_each: int, tokens: list[int] | None = None
) -> Admission:
    """Reserve the request's sequences (and ``tokens``: per id, its prompt plus max_tokens
    times its sequences); the Admission must be released on every path out."""
    token_counts = tokens if tokens is not None else [0] * len(request_ids)
    check_capacity(state, len(request_ids) * seqs_each, sum(token_counts))
    for rid in request_ids:
        if rid in state.inflight:
            raise BadRequestError(f"A request with id {rid!r} is already running.", "request_id")
    for rid, count in zip(request_ids, token_counts, strict=True):
        state.inflight[rid] = seqs_each
        state.inflight_tokens[rid] = count
    state.admitted += len(request_ids) * seqs_each
    state.admitted_tokens += sum(token_counts)
    return Admission(state, request_ids)


def admitted_tokens(job: PreparedPrompt) -> int:
    """What one prepared prompt counts against --max-num-admitted-tokens: each of its
    sequences may come to hold the prompt and max_tokens in the KV cache."""
    return job.params.n * (len(job.prompt_token_ids) + (job.params.max_tokens or 0))


class Admission:
    """A request's place in ``ServerState.inflight``: each id is released exactly once, by
    ``release`` (one id, when its engine request ends) or ``release_all`` (the request's
    owner leaving by any path: finish, error, disconnect, cancellation, shutdown)."""

    __slots__ = ("state", "pending")

    def __init__(self, state: ServerState, request_ids: list[str]) -> None:
        self.state = state
        self.pending = set(request_ids)

    def release(self, request_id: str) -> None:
        if request_id in self.pending:
            self.pending.discard(request_id)
            state = self.state
            state.admitted -= state.inflight.pop(request_id)
            state.admitted_tokens -= state.inflight_tokens.pop(request_id)
            if state.draining and not state.inflight:
                state.drained.set()

    def release_all(self) -> None:
        for request_id in list(self.pending):
            self.release(request_id)
