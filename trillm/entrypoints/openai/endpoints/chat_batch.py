"""POST /v1/chat/completions/batch (vLLM's): N conversations in one request, one chat
completion each, answered as one chat.completion whose choice ``i`` is conversation ``i``'s.

Each conversation is a chat request of its own (the body's fields with its ``messages``),
checked, rendered and submitted as /v1/chat/completions does; they run in the engine at once.
Like vLLM, no streaming and no tools; ``n`` must be 1 (a choice is a conversation) and beam
search is refused, each by name."""

from __future__ import annotations

import time
import uuid
from typing import Any

import trio

from trillm.entrypoints.openai.endpoints.base import ServerState
from trillm.entrypoints.openai.endpoints.budgets import check_sequences
from trillm.entrypoints.openai.endpoints.chat import start_chat
from trillm.entrypoints.openai.endpoints.chat_output import ChatAnswer
from trillm.entrypoints.openai.endpoints.generation import Generation
from trillm.entrypoints.openai.http.errors import BadRequestError
from trillm.entrypoints.openai.schemas.protocol import ChatCompletionRequest
from trillm.entrypoints.openai.schemas.structuring import structure_body

ROUTE = "/v1/chat/completions/batch"
# Fields a batch refuses when set (vLLM's batch mode: no streaming, no tools).
_REFUSED = {
    "stream": "streaming",
    "stream_options": "streaming",
    "tools": "tools",
    "tool_choice": "tools",
    "use_beam_search": "beam search",
}


async def batch_requests(
    state: ServerState, body: dict[str, Any], body_bytes: int | None
) -> list[ChatCompletionRequest]:
    """One chat request per conversation of ``body['messages']``, or a 400 naming the field."""
    conversations = body.get("messages")
    if not (
        isinstance(conversations, list)
        and conversations
        and all(isinstance(c, list) for c in conversations)
    ):
        raise BadRequestError(
            f"'messages' on {ROUTE} must be a non-empty list of conversations, each a list "
            "of messages.",
            "messages",
        )
    for field, feature in _REFUSED.items():
        if body.get(field) not in (None, False, [], "none"):
            raise BadRequestError(f"'{field}': {feature} is not supported on {ROUTE}.", field)
    if body.get("n", 1) != 1:
        raise BadRequestError(f"'n' must be 1 on {ROUTE} (one choice per conversation).", "n")
    check_sequences(len(conversations), 1, state.max_sequences_per_request)
    rid = body.get("request_id")
    reqs = []
    for i, conversation in enumerate(conversations):
        one = {**body, "messages": conversation}
        if isinstance(rid, str):  # each conversation its own id, as vLLM's "<id>_<i>"
            one["request_id"] = f"{rid}_{i}"
        reqs.append(await structure_body(ChatCompletionRequest, one, body_bytes))
    return reqs


async def create_batch_chat_completion(
    state: ServerState, reqs: list[ChatCompletionRequest]
) -> dict[str, Any]:
    started: list[tuple[ChatAnswer, Generation]] = []
    try:
        for req in reqs:  # all checked and submitted before any is read
            started.append(await start_chat(state, req))
    except BaseException:
        for _, gen in started:
            await gen.aclose()
        raise
    bodies: list[dict[str, Any]] = [{} for _ in started]
    async with trio.open_nursery() as nursery:  # read at once: none waits behind another
        for i, (answer, gen) in enumerate(started):
            nursery.start_soon(_read, answer, gen, bodies, i)
    return _joined(state, bodies)


async def _read(answer: ChatAnswer, gen: Generation, bodies: list[dict[str, Any]], i: int) -> None:
    bodies[i] = await answer.full(gen)


def _joined(state: ServerState, bodies: list[dict[str, Any]]) -> dict[str, Any]:
    choices = []
    prompt = completion = cached = created = 0
    for i, body in enumerate(bodies):
        choices.append({**body["choices"][0], "index": i})
        usage = body["usage"]
        prompt += usage["prompt_tokens"]
        completion += usage["completion_tokens"]
        cached += (usage["prompt_tokens_details"] or {}).get("cached_tokens", 0)
        created += (usage["prompt_tokens_details"] or {}).get("created_cache_tokens", 0)
    details = None
    if state.enable_prompt_tokens_details:
        details = {"cached_tokens": cached, "created_cache_tokens": created}
    return {
        "id": f"chatcmpl-{uuid.uuid4().hex}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": bodies[0]["model"],
        "choices": choices,
        "usage": {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": details,
        },
        "prompt_logprobs": None,
        "prompt_token_ids": None,
    }
