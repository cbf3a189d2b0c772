"""``trillm chat`` and ``trillm complete``: vLLM's client commands for a running server.

Both stream their answers from an OpenAI-compatible server (``--url``, default
``http://localhost:8000/v1``), take the model from ``--model-name`` or else the first one
``/models`` lists, and the key from ``--api-key`` or else ``OPENAI_API_KEY``. With ``-q/--quick``
they send one message and exit; otherwise they read one message per line from stdin until
end of file (interactive at a terminal, a script when piped). ``chat`` keeps the conversation;
``complete`` sends each line as a new prompt. ``--stats`` prints time to first token and
tokens per second after each answer.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # imported when a command runs: building the parser (--help) goes without
    import httpx

DEFAULT_URL = "http://localhost:8000/v1"


def add_client_parsers(subparsers: Any) -> None:
    chat = subparsers.add_parser(
        "chat",
        help="Chat with a running server (streamed).",
        description="Chat with the model of a running OpenAI-compatible server.",
    )
    _add_query_flags(chat)
    chat.add_argument("--system-prompt", help="A system message that opens the conversation.")
    chat.add_argument(
        "-q", "--quick", metavar="MESSAGE", help="Send MESSAGE, print the answer, exit."
    )
    chat.set_defaults(func=run_chat)
    complete = subparsers.add_parser(
        "complete",
        help="Complete prompts with a running server (streamed).",
        description="Complete prompts with the model of a running OpenAI-compatible server.",
    )
    _add_query_flags(complete)
    complete.add_argument("--max-tokens", type=int, help="Most tokens per completion.")
    complete.add_argument(
        "-q", "--quick", metavar="PROMPT", help="Complete PROMPT, print it, exit."
    )
    complete.set_defaults(func=run_complete)


def _add_query_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--url", default=DEFAULT_URL, help=f"The server's API base (default: {DEFAULT_URL})."
    )
    p.add_argument("--model-name", help="The model (default: the first one /models lists).")
    p.add_argument("--api-key", help="The server's API key (default: OPENAI_API_KEY).")
    p.add_argument(
        "--stats", action="store_true", help="Print TTFT and tokens per second after each answer."
    )


def _http_client(args: argparse.Namespace) -> httpx.Client:
    """The connection pool to the server at ``--url``, with its key."""
    import httpx

    key = args.api_key or os.environ.get("OPENAI_API_KEY", "EMPTY")
    return httpx.Client(
        base_url=args.url.rstrip("/"),
        headers={"Authorization": f"Bearer {key}"},
        timeout=httpx.Timeout(600.0, connect=10.0),
    )


class Client:
    """One server's model, asked over ``http`` (which the caller owns and closes)."""

    def __init__(self, args: argparse.Namespace, http: httpx.Client) -> None:
        self.http = http
        self.stats = args.stats
        self.model = args.model_name or self._first_model()
        print(f"Using model: {self.model}", flush=True)

    def _first_model(self) -> str:
        response = self.http.get("/models")
        _raise_for(response)
        return str(response.json()["data"][0]["id"])

    def stream(self, path: str, body: dict[str, Any], text_of: Any) -> str:
        """POST ``body`` streamed; print each piece of text as it comes; -> the whole text."""
        body = {"model": self.model, "stream": True, **body}
        if self.stats:
            body["stream_options"] = {"include_usage": True}
        start, first, tokens, pieces = time.perf_counter(), None, 0, []
        with self.http.stream("POST", path, json=body) as response:
            if response.status_code != 200:
                response.read()
                _raise_for(response)
            for chunk in _events(response.iter_lines()):
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
                for choice in chunk.get("choices") or ():
                    piece = text_of(choice)
                    if piece:
                        first = time.perf_counter() - start if first is None else first
                        pieces.append(piece)
                        print(piece, end="", flush=True)
        print(flush=True)
        if self.stats and first is not None:
            total = time.perf_counter() - start
            print(f"TTFT: {first * 1e3:.2f} ms")
            print(f"TPS:  {tokens / total:.2f} tokens/s ({tokens} tokens in {total:.2f}s)")
        return "".join(pieces)


class ServerError(RuntimeError):
    pass


def _raise_for(response: httpx.Response) -> None:
    if response.status_code == 200:
        return
    try:
        message = response.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = response.text
    raise ServerError(f"the server answered {response.status_code}: {message}")


def _events(lines: Iterator[str]) -> Iterator[dict[str, Any]]:
    for line in lines:
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            return
        yield json.loads(data)


def _lines(prompt: str) -> Iterator[str]:
    """Lines from stdin until end of file (the prompt shown only at a terminal)."""
    interactive = sys.stdin.isatty()
    while True:
        try:
            line = input(prompt) if interactive else sys.stdin.readline()
        except EOFError:
            return
        if not interactive:
            if not line:
                return
            line = line.rstrip("\n")
        yield line


def run_chat(args: argparse.Namespace) -> int:
    return _run(args, _chat)


def run_complete(args: argparse.Namespace) -> int:
    return _run(args, _complete)


def _run(args: argparse.Namespace, session: Any) -> int:
    import httpx

    try:
        with _http_client(args) as http:
            session(Client(args, http), args)
    except (ServerError, httpx.HTTPError) as exc:
        print(f"trillm {args.command}: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(file=sys.stderr)
    return 0


def _chat(client: Client, args: argparse.Namespace) -> None:
    conversation: list[dict[str, str]] = []
    if args.system_prompt is not None:
        conversation.append({"role": "system", "content": args.system_prompt})
    messages = [args.quick] if args.quick is not None else _lines("> ")
    if args.quick is None:
        print("Please enter a message for the chat model:", flush=True)
    for message in messages:
        conversation.append({"role": "user", "content": message})
        answer = client.stream(
            "/chat/completions",
            {"messages": conversation},
            lambda choice: (choice.get("delta") or {}).get("content"),
        )
        conversation.append({"role": "assistant", "content": answer})


def _complete(client: Client, args: argparse.Namespace) -> None:
    extra = {} if args.max_tokens is None else {"max_tokens": args.max_tokens}
    prompts = [args.quick] if args.quick is not None else _lines("> ")
    if args.quick is None:
        print("Please enter prompt to complete:", flush=True)
    for prompt in prompts:
        client.stream("/completions", {"prompt": prompt, **extra}, lambda c: c.get("text"))
