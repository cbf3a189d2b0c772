"""Stage 2 in one place (issue 12): ``trillm/engine/preprocess.py``.

- the context-length check runs once per prompt, through the Python API and through the
  HTTP handlers (which hand the prepared prompt to the engine: nothing is checked twice);
- the Python API tokenizes long prompts off the event loop (the loop keeps ticking);
- nothing under the engine, core and structured-output packages imports the entrypoints.
"""

from __future__ import annotations

import ast
import time
from pathlib import Path
from typing import Any

import pytest
import trio

import trillm
from trillm import SamplingParams, open_engine
from trillm.engine.preprocess import InvalidRequestError, PreparedPrompt, Preprocessor
from trillm.engine.text_tokenizer import INLINE_TOKENIZE_CHARS
from trillm.executor.abstract import FAKE_RUNNER

PACKAGE = Path(trillm.__file__).parent


# ---------------------------------------------------------------- the layering


def _imported_modules(path: Path) -> list[str]:
    """Every module a file imports, at any depth (function-level imports included)."""
    names = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
            names += [f"{node.module}.{alias.name}" for alias in node.names]
    return names


@pytest.mark.parametrize("package", ["engine", "core", "structured_output"])
def test_no_engine_module_imports_the_entrypoints(package):
    files = sorted((PACKAGE / package).rglob("*.py"))
    assert files
    offenders = [
        f"{f.relative_to(PACKAGE.parent)}: {name}"
        for f in files
        for name in _imported_modules(f)
        if name == "trillm.entrypoints" or name.startswith("trillm.entrypoints.")
    ]
    assert not offenders, offenders


def test_the_import_walk_sees_function_level_imports(tmp_path):
    # The static test above can fail: a lazy import inside a method is found.
    f = tmp_path / "m.py"
    f.write_text("def f():\n    from trillm.entrypoints.chat_utils import render_chat\n")
    assert "trillm.entrypoints.chat_utils" in _imported_modules(f)


# ---------------------------------------------------------------- one context check


@pytest.fixture(scope="module")
def model_path(tiny_model_factory):
    return tiny_model_factory("llama")


@pytest.fixture
def context_checks(monkeypatch):
    """Counts calls of THE context check (``Preprocessor.resolve_max_tokens``)."""
    calls: list[tuple[int, int | None]] = []
    original = Preprocessor.resolve_max_tokens

    def counting(self, prompt_len, requested, **kwargs):
        calls.append((prompt_len, requested))
        return original(self, prompt_len, requested, **kwargs)

    monkeypatch.setattr(Preprocessor, "resolve_max_tokens", counting)
    return calls


def _engine(model_path: str, **kwargs: Any):
    return open_engine(model_path, runner=FAKE_RUNNER, max_model_len=256, **kwargs)


async def _drain(stream) -> Any:
    out = None
    async with stream as outputs:
        async for out in outputs:
            pass
    return out


def test_python_api_checks_the_context_once_per_request(model_path, context_checks):
    async def main():
        async with _engine(model_path) as engine:
            out = await _drain(engine.generate("Hello there", SamplingParams(max_tokens=3, n=3)))
            assert len(out.outputs) == 3
            assert len(context_checks) == 1  # n samples, one check
            messages = [{"role": "user", "content": "Hi"}]
            await _drain(engine.chat(messages, SamplingParams(max_tokens=2)))
            assert len(context_checks) == 2
            # A prepared prompt is submitted as is: no second check.
            prepared = await engine.preprocessor.prepare("Hi", SamplingParams(max_tokens=2))
            assert len(context_checks) == 3
            await _drain(engine.generate(prepared))
            assert len(context_checks) == 3
            with pytest.raises(InvalidRequestError, match="maximum context length is 256"):
                await _drain(engine.generate("Hi", SamplingParams(max_tokens=1000)))

    trio.run(main)


def test_http_handlers_check_the_context_once_per_prompt(model_path, context_checks):
    from trillm.entrypoints.openai.endpoints.base import ServerState
    from trillm.entrypoints.openai.endpoints.chat import create_chat_completion
    from trillm.entrypoints.openai.endpoints.completion import create_completion
    from trillm.entrypoints.openai.http.errors import BadRequestError
    from trillm.entrypoints.openai.metrics.prometheus import ServerMetrics
    from trillm.entrypoints.openai.schemas.protocol import ChatCompletionRequest, CompletionRequest
    from trillm.entrypoints.openai.schemas.structuring import structure

    submitted: list[Any] = []

    async def main():
        async with _engine(model_path) as engine, trio.open_nursery() as nursery:
            original = engine.generate_many  # the HTTP layer's one submit path

            def spy(prompts, *args, **kwargs):
                submitted.extend(prompts)
                return original(prompts, *args, **kwargs)

            engine.generate_many = spy
            state = ServerState(engine, ["tiny"], ServerMetrics(engine, "tiny"), nursery)
            chat = structure(
                ChatCompletionRequest,
                {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2},
            )
            body = await create_chat_completion(state, chat)
            assert body["usage"]["completion_tokens"] == 2
            assert len(context_checks) == 1
            two = structure(
                CompletionRequest, {"prompt": ["a b", "c d e"], "max_tokens": 2, "n": 2}
            )
            body = await create_completion(state, two)
            assert len(body["choices"]) == 4
            assert len(context_checks) == 3  # one per prompt, none in the engine
            # What reached the engine was prepared: generate did not check it again.
            assert len(submitted) == 3 and all(isinstance(p, PreparedPrompt) for p in submitted)
            # Chat's prompt too long for the context names "messages".
            long = structure(
                ChatCompletionRequest, {"messages": [{"role": "user", "content": "word " * 400}]}
            )
            with pytest.raises(BadRequestError) as info:
                await create_chat_completion(state, long)
            assert info.value.param == "messages"
            assert "maximum context length is 256" in str(info.value)
            nursery.cancel_scope.cancel()

    trio.run(main)


# ---------------------------------------------------------------- long prompts off the loop


class _SlowTokenizer:
    """The engine's tokenizer, with an encode that takes ``delay`` seconds of real (blocking)
    work and records how far a ticker on the event loop got meanwhile."""

    def __init__(self, tok: Any, ticks: list[int], delay: float) -> None:
        self._tok = tok
        self._ticks = ticks
        self._delay = delay
        self.during: list[int] = []

    def encode(self, text: str, **kwargs: Any) -> list[int]:
        start = self._ticks[0]
        time.sleep(self._delay)
        self.during.append(self._ticks[0] - start)
        return self._tok.encode(text, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tok, name)


def test_python_api_tokenizes_long_prompts_off_the_event_loop(model_path):
    ticks = [0]

    async def ticker(stop: trio.Event) -> None:
        while not stop.is_set():
            ticks[0] += 1
            await trio.sleep(0.005)

    async def main():
        async with _engine(model_path) as engine:
            pre = engine.preprocessor
            pre.max_prompt_chars()  # (computed from the real tokenizer's vocabulary)
            slow = _SlowTokenizer(pre.tokenizer, ticks, 0.4)
            pre.tokenizer = slow
            params = SamplingParams(max_tokens=2, truncate_prompt_tokens=8)
            long_prompt = "word " * (INLINE_TOKENIZE_CHARS // 5 + 10)
            for prompt in ("a short prompt", long_prompt):
                stop = trio.Event()
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(ticker, stop)
                    await trio.sleep(0.02)
                    out = await _drain(engine.generate(prompt, params))
                    stop.set()
                assert len(out.prompt_token_ids) <= 8 and len(out.outputs[0].token_ids) == 2
            return slow.during

    short_ticks, long_ticks = trio.run(main)
    assert short_ticks == 0  # a short prompt is tokenized inline: the loop waits (cheap)
    assert long_ticks >= 5, long_ticks  # a long one in a thread: the loop kept ticking
