"""JSON pieces the chat and completion answers share (stage 11): an SSE chunk's prefix, one
position's logprobs (the chosen value and the ranked tops), and a prompt's logprobs as JSON
ready to embed."""

from __future__ import annotations

import math
from typing import Any

import orjson
import trio

from trillm.engine.logprobs import in_rank_order
from trillm.outputs import Logprob, PromptLogprobs

# Prompt positions serialized between two event-loop checkpoints: at 20 logprobs, ~5k entries
# (a few ms), so a large answer never holds other requests and /health for long.
_PROMPT_LOGPROB_POSITIONS_PER_SLICE = 256


def chunk_head(request_id: str, object_name: bytes, created: int, model_name: str) -> bytes:
    """What every chunk of a stream starts with, up to its choices:
    ``data: {"id":..,"object":..,"created":..,"model":..,"choices":[``."""
    return (
        b'data: {"id":'
        + orjson.dumps(request_id)
        + b',"object":"'
        + object_name
        + b'","created":'
        + str(created).encode()
        + b',"model":'
        + orjson.dumps(model_name)
        + b',"choices":['
    )


def position_logprobs(
    entry: dict[int, Logprob], token_id: int, listed: bool = False
) -> tuple[float, list[tuple[int, str, float]]]:
    """One position's logprobs, as the output processor formatted them: the chosen token's
    value and ``[(id, text, logprob)]`` by rank (``in_rank_order``: no sorting here), or with
    ``listed`` (``logprob_token_ids``) as formatted: the sampled token, then the ids asked."""
    chosen = entry[token_id].logprob if token_id in entry else -math.inf
    items = list(entry.items()) if listed else in_rank_order(entry)
    tops = [(tid, lp.decoded_token or "", lp.logprob) for tid, lp in items]
    return chosen, tops


async def prompt_logprobs_json(prompt_logprobs: PromptLogprobs | None) -> orjson.Fragment | None:
    """vLLM's shape, ``[null | {token_id: {logprob, rank, decoded_token}}]`` per prompt token,
    as JSON ready to embed in the answer: serialized a slice of positions at a time, yielding
    to the event loop between slices, and never built whole as Python dicts (~7x the JSON)."""
    if prompt_logprobs is None:
        return None
    pieces: list[bytes] = []
    step = _PROMPT_LOGPROB_POSITIONS_PER_SLICE
    for start in range(0, len(prompt_logprobs), step):
        rows = [_prompt_position_json(entry) for entry in prompt_logprobs[start : start + step]]
        pieces.append(orjson.dumps(rows)[1:-1])  # the rows without their brackets
        await trio.lowlevel.checkpoint()
    return orjson.Fragment(b"[" + b",".join(pieces) + b"]")


def _prompt_position_json(entry: dict[int, Logprob] | None) -> dict[str, Any] | None:
    if entry is None:
        return None
    return {
        str(tid): {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": lp.decoded_token}
        for tid, lp in entry.items()
    }
