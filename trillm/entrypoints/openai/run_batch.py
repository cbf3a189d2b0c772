"""``trillm run-batch``: OpenAI's batch file format answered by the server's own routes.

Each input line is ``{"custom_id", "method": "POST", "url", "body"}``; each output line, in the
input's order, is ``{"id", "custom_id", "response": {"status_code", "request_id", "body"},
"error"}`` as vLLM's ``run-batch`` writes it. A body goes through the app ``trillm serve``
builds (``http/app.py``), in process and without a socket, so an answer is byte for byte what
the same request gets over HTTP: the same validation, budgets and errors. A failed line is
reported on its own line and never stops the batch.

Memory stays bounded whatever the file's size: lines are read as they are needed, and at most
``2 * max_num_seqs`` requests are in flight or waiting to be written in order (a slot is
released only when its line has been written).
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial
from typing import TYPE_CHECKING, Any

import httpx
import trio

from trillm.entrypoints.openai.api_server import ServerOptions, open_server_state
from trillm.entrypoints.openai.http.app import build_app

if TYPE_CHECKING:
    from quart.typing import TestClientProtocol

logger = logging.getLogger("trillm.run_batch")

# The routes a line may name (OpenAI's batch API and vLLM's run-batch); the app answers a
# route the model cannot serve (embeddings on a generative model, ...) with its usual error.
BATCH_URLS = (
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/embeddings",
    "/v1/responses",
    "/v1/score",
    "/score",
    "/v1/rerank",
    "/rerank",
    "/v2/rerank",
)
MAX_LINE_BYTES = 64 * 2**20  # one request line (a request body is bounded by the app too)
READ_CHUNK_BYTES = 2**20  # a local input file is read this much at a time


class BatchLineError(ValueError):
    """A line that is no request: reported on its output line (with its custom_id when it has
    one), and the batch goes on."""

    def __init__(self, message: str, custom_id: str = "") -> None:
        super().__init__(message)
        self.custom_id = custom_id


def parse_line(line: str) -> tuple[str, str, dict[str, Any]]:
    """-> (custom_id, url, body); BatchLineError naming what is wrong."""
    try:
        item = json.loads(line)
    except json.JSONDecodeError as exc:
        raise BatchLineError(f"The line is not JSON: {exc}.") from None
    if not isinstance(item, dict):
        raise BatchLineError("A batch line must be a JSON object.")
    custom_id, method, url, body = (item.get(k) for k in ("custom_id", "method", "url", "body"))
    if not isinstance(custom_id, str):
        raise BatchLineError("'custom_id' must be a string.")
    problem = None
    if method != "POST":
        problem = f"'method' must be 'POST', got {method!r}."
    elif url not in BATCH_URLS:
        problem = f"URL {url!r} is not served in a batch; supported: {', '.join(BATCH_URLS)}."
    elif not isinstance(body, dict):
        problem = "'body' must be a JSON object."
    elif body.get("stream"):
        problem = "A batch request must not be sent in stream mode ('stream': true)."
    if problem is not None:
        raise BatchLineError(problem, custom_id)
    assert isinstance(url, str) and isinstance(body, dict)  # checked above
    return custom_id, url, body


def output_line(custom_id: str, status: int, body: Any, error: Any) -> str:
    response = {"status_code": status, "request_id": f"trillm-batch-{uuid.uuid4().hex}"}
    response["body"] = body
    line = {"id": f"trillm-{uuid.uuid4().hex}", "custom_id": custom_id, "response": response}
    line["error"] = error
    return json.dumps(line, ensure_ascii=False)


class OrderedWriter:
    """Writes results in the input's order as soon as every earlier one is in; a result's slot
    is released once it is written."""

    def __init__(self, write: Any) -> None:
        self._write = write
        self._waiting: dict[int, tuple[str, trio.CapacityLimiter, object]] = {}
        self._next = 0
        self.written = 0

    async def put(self, index: int, line: str, slot: trio.CapacityLimiter, owner: object) -> None:
        self._waiting[index] = (line, slot, owner)
        # NOTE: an entry is popped before the write awaits, so a second caller arriving
        # meanwhile finds nothing to write and leaves the rest to this one.
        while self._next in self._waiting:
            ready, held, who = self._waiting.pop(self._next)
            await self._write(ready + "\n")
            held.release_on_behalf_of(who)
            self._next += 1
            self.written += 1


@asynccontextmanager
async def _input_lines(path_or_url: str) -> AsyncIterator[AsyncIterator[str]]:
    """The non-blank lines of a local file or an http(s) URL (GET), read as needed."""
    if path_or_url.startswith(("http://", "https://")):
        async with (
            httpx.AsyncClient(timeout=httpx.Timeout(60.0)) as client,
            client.stream("GET", path_or_url) as response,
        ):
            response.raise_for_status()
            yield _nonblank(response.aiter_bytes())
    else:
        async with await trio.open_file(path_or_url, "rb") as f:
            yield _nonblank(_file_chunks(f))


async def _file_chunks(f: Any) -> AsyncIterator[bytes]:
    while chunk := await f.read(READ_CHUNK_BYTES):
        yield chunk


async def _nonblank(chunks: AsyncIterator[bytes]) -> AsyncIterator[str]:
    """The stripped non-blank lines of a byte stream. A line longer than MAX_LINE_BYTES is
    refused as soon as that many bytes of it have arrived, never read whole first."""
    pending = bytearray()
    async for chunk in chunks:
        start = 0
        while (end := chunk.find(b"\n", start)) != -1:
            pending += chunk[start:end]
            start = end + 1
            line = _line(pending)
            pending = bytearray()
            if line:
                yield line
        pending += chunk[start:]
        _line_size(pending)
    line = _line(pending)
    if line:
        yield line


def _line(data: bytearray) -> str:
    _line_size(data)
    return data.decode("utf-8").strip()


def _line_size(data: bytearray) -> None:
    if len(data) > MAX_LINE_BYTES:
        raise ValueError(f"An input line is longer than {MAX_LINE_BYTES} bytes.")


async def _upload(url: str, path: str) -> None:
    """PUT the written file to ``url`` (vLLM's run-batch takes an http(s) output the same way)."""
    async with httpx.AsyncClient(timeout=httpx.Timeout(1000.0)) as client:
        data = await trio.Path(path).read_bytes()
        response = await client.put(url, content=data)
        response.raise_for_status()


async def run_batch(
    model: str | None,
    engine_args: dict[str, Any],
    opts: ServerOptions,
    input_file: str,
    output_file: str,
    output_tmp_dir: str | None = None,
) -> int:
    """Answer every line of ``input_file`` into ``output_file``; -> the number of lines."""
    from trillm.engine.engine_startup import open_engine

    upload = output_file.startswith(("http://", "https://"))
    if upload:
        fd, local = tempfile.mkstemp(suffix=".jsonl", dir=output_tmp_dir, prefix="batch_output_")
        os.close(fd)
    else:
        local = output_file
    engine_ctx = open_engine(model, chat_template=opts.chat_template, **engine_args)
    try:
        # The input first: a missing file fails before the model loads or the output exists.
        async with (
            _input_lines(input_file) as lines,
            engine_ctx as engine,
            trio.open_nursery() as producers,
        ):
            state = await open_server_state(engine, opts, producers)
            client = build_app(state).test_client()
            slots = trio.CapacityLimiter(2 * engine.config.scheduler.max_num_seqs)
            async with await trio.open_file(local, "w", encoding="utf-8") as out:
                writer = OrderedWriter(out.write)
                async with trio.open_nursery() as batch:
                    index = 0
                    async for line in lines:
                        owner = object()
                        await slots.acquire_on_behalf_of(owner)
                        answer = partial(_answer, client, line, index, writer, slots, owner)
                        batch.start_soon(answer)
                        index += 1
            producers.cancel_scope.cancel()
        logger.info("Batch complete: %d lines written to %s.", writer.written, output_file)
        if upload:
            await _upload(output_file, local)
    finally:
        if upload:
            os.unlink(local)
    return writer.written


async def _answer(
    client: TestClientProtocol,
    line: str,
    index: int,
    writer: OrderedWriter,
    slots: trio.CapacityLimiter,
    owner: object,
) -> None:
    try:
        custom_id, url, body = parse_line(line)
    except BatchLineError as exc:
        await writer.put(index, output_line(exc.custom_id, 400, None, str(exc)), slots, owner)
        return
    response = await client.post(url, json=body)
    data = await response.get_data(as_text=False)
    status = response.status_code
    try:
        answer = json.loads(data)
    except ValueError:  # every route answers JSON; this keeps a line for anything else
        answer = {"error": {"message": data.decode(errors="replace"), "code": status}}
    ok = status == 200
    result = output_line(custom_id, status, answer if ok else None, None if ok else answer)
    await writer.put(index, result, slots, owner)
