"""What the multimodal HTTP tests share (Llama 4, LLaVA-OneVision, Qwen2-Audio, Qwen2-VL and
its videos in tests/entrypoints): a module's ``trillm serve`` with the official openai client
on it, and a greedy chat of one user message whose reply carries its token ids."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
from server_harness import ServerProcess

MAX_NEW = 8


def openai_server(
    args: list[str], log: Path, timeout: float | None = None
) -> Iterator[openai.OpenAI]:
    """``trillm serve ARGS`` and a client on it (``yield from`` in a module's fixture); the
    server must stop cleanly at the module's end. ``timeout``: the client's, per request."""
    srv = ServerProcess(args, log).start()
    options = {} if timeout is None else {"timeout": timeout}
    with openai.OpenAI(base_url=srv.base_url, api_key="unused", max_retries=0, **options) as client:
        yield client
    assert srv.stop() == 0, srv.log()


def greedy_chat(
    client: openai.OpenAI,
    parts: Any,
    *,
    model: str,
    max_tokens: int = MAX_NEW,
    extra_body: dict[str, Any] | None = None,
    **kwargs: Any,
) -> Any:
    """One user message of ``parts`` answered greedily, its prompt and reply token ids
    returned (``kwargs``: the client's own fields, ``extra_body``: vLLM's)."""
    return client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": parts}],
        max_tokens=max_tokens,
        temperature=0.0,
        extra_body={"return_token_ids": True, "ignore_eos": True, **(extra_body or {})},
        **kwargs,
    )
