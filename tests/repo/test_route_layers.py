"""A request's route goes top to bottom: each module entered once (docs/architecture.md, "One
completion, from its route to its SSE chunk").

One server runs in-process (the quart-trio test client, the engine with its fake runner) and
answers /v1/completions (two prompts, echo, logprobs), /v1/chat/completions and /v1/responses,
each streamed and as JSON, under ``sys.setprofile``. Every call from one ``trillm`` module
straight into another is an edge caller -> callee, and every runtime import between the
modules met an edge importer -> imported. The rule: that graph has no cycle. Then one order,
top to bottom, holds every call and every import: no module calls into a module above it (no
template method whose base calls its subclass, no callback into the caller's module), so no
module is re-entered from below and on every call stack each module appears once.
"""

from __future__ import annotations

import ast
import importlib
import sys
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import trio

from trillm import open_engine
from trillm.executor.abstract import FAKE_RUNNER

Edge = tuple[str, str]

# What the traced requests ask: every chunk path of each API (echo, logprobs, usage).
_COMPLETION = {"prompt": ["a b c", "d e"], "max_tokens": 3, "echo": True, "logprobs": 2}
_CHAT = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "logprobs": True}
_RESPONSES = {"input": "Hi", "max_output_tokens": 3}
_USAGE = {"stream_options": {"include_usage": True, "continuous_usage_stats": True}}
_REQUESTS = [
    ("/v1/completions", _COMPLETION),
    ("/v1/completions", {**_COMPLETION, "stream": True, **_USAGE}),
    ("/v1/chat/completions", {**_CHAT, "top_logprobs": 2}),
    ("/v1/chat/completions", {**_CHAT, "stream": True, **_USAGE}),
    ("/v1/responses", _RESPONSES),
    ("/v1/responses", {**_RESPONSES, "stream": True}),
]


# ---------------------------------------------------------------- the checker


@contextmanager
def traced_calls(prefix: str) -> Iterator[Counter[Edge]]:
    """Count each call from a module named ``prefix...`` straight into another one."""
    calls: Counter[Edge] = Counter()

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event != "call" or frame.f_back is None:
            return
        callee = frame.f_globals.get("__name__", "")
        caller = frame.f_back.f_globals.get("__name__", "")
        if callee != caller and callee.startswith(prefix) and caller.startswith(prefix):
            calls[(caller, callee)] += 1

    sys.setprofile(profile)
    try:
        yield calls
    finally:
        sys.setprofile(None)


def runtime_imports(module: str, among: set[str]) -> set[str]:
    """The modules of ``among`` that ``module`` imports when it runs (at any depth, functions
    included; ``if TYPE_CHECKING:`` blocks left out: they are never executed)."""
    path = Path(importlib.import_module(module).__file__ or "")
    tree = ast.parse(path.read_text(), str(path))
    type_only = {
        id(node)
        for block in ast.walk(tree)
        if isinstance(block, ast.If) and ast.unparse(block.test).endswith("TYPE_CHECKING")
        for stmt in block.body
        for node in ast.walk(stmt)
    }
    found = set()
    for node in ast.walk(tree):
        if id(node) in type_only:
            continue
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                found.add(full if full in among else node.module)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return (found & among) - {module}


def find_cycle(edges: dict[Edge, str]) -> list[str] | None:
    """One cycle of the graph, as ``a -(call)-> b -(import)-> ... -> a``; None: acyclic."""
    graph: dict[str, list[str]] = {}
    for a, b in sorted(edges):
        graph.setdefault(a, []).append(b)
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in graph.get(node, []):
            if state.get(nxt) == 1:
                loop = [*path[path.index(nxt) :], nxt]
                return [f"{a} -({edges[(a, b)]})->" for a, b in zip(loop, loop[1:])] + [nxt]
            if nxt not in state and (found := visit(nxt)) is not None:
                return found
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (found := visit(start)) is not None:
            return found
    return None


def route_graph(calls: Counter[Edge]) -> dict[Edge, str]:
    """The calls seen, and the runtime imports among the modules they touch."""
    modules = {m for edge in calls for m in edge}
    edges = {edge: "call" for edge in calls}
    for module in modules:
        for imported in runtime_imports(module, modules):
            edges.setdefault((module, imported), "import")
    return edges


def _trace(run: Callable[[], Any], prefix: str) -> dict[Edge, str]:
    with traced_calls(prefix) as calls:
        run()
    return route_graph(calls)


# ---------------------------------------------------------------- the route


async def _serve_requests(model_path: str, calls: Counter[Edge]) -> list[tuple[int, bytes]]:
    """The answers; ``calls``: what the requests called, from the gate to the last chunk (the
    engine's own tasks, steps 5 and 6, included; its start and stop left out)."""
    from trillm.entrypoints.openai.endpoints.base import ServerState
    from trillm.entrypoints.openai.http.app import build_app
    from trillm.entrypoints.openai.metrics.prometheus import ServerMetrics

    answers = []
    async with (
        open_engine(model_path, runner=FAKE_RUNNER, max_model_len=256) as engine,
        trio.open_nursery() as nursery,
    ):
        state = ServerState(engine, ["tiny"], ServerMetrics(engine, "tiny"), nursery)
        client = build_app(state).test_client()
        with traced_calls("trillm.") as traced:
            for path, body in _REQUESTS:
                response = await client.post(path, json=body)
                answers.append((response.status_code, await response.get_data()))
        calls.update(traced)
        nursery.cancel_scope.cancel()
    return answers


@pytest.fixture(scope="module")
def route(tiny_model_factory) -> tuple[dict[Edge, str], list[tuple[int, bytes]]]:
    calls: Counter[Edge] = Counter()
    answers = trio.run(_serve_requests, tiny_model_factory("llama"), calls)
    return route_graph(calls), answers


def test_the_traced_requests_took_their_whole_route(route):
    edges, answers = route
    assert [status for status, _ in answers] == [200] * len(_REQUESTS), answers
    assert b'"usage"' in answers[1][1] and answers[1][1].endswith(b"data: [DONE]\n\n")
    seen = {m for edge in edges for m in edge}
    endpoints = "trillm.entrypoints.openai.endpoints."
    for stage in ("completion", "chat", "responses", "sse_stream", "generation", "admission"):
        assert endpoints + stage in seen, stage
    assert "trillm.engine.request_stream" in seen and "trillm.engine.core" in seen


def test_a_requests_route_never_climbs_back_into_a_module(route):
    edges, _ = route
    assert find_cycle(edges) is None, "\n".join(find_cycle(edges) or [])


# ---------------------------------------------------------------- the checker can fail

_DRIVER = """
class Driver:  # a template method: the base runs the subclass's hook
    def run(self):
        return self.hook()
"""
_ENDPOINT = """
from route_probe.driver import Driver

class Endpoint(Driver):
    def hook(self):
        return 1
"""


def test_the_checker_finds_a_template_method(tmp_path, monkeypatch):
    package = tmp_path / "route_probe"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "driver.py").write_text(_DRIVER)
    (package / "endpoint.py").write_text(_ENDPOINT)
    monkeypatch.syspath_prepend(str(tmp_path))
    endpoint = importlib.import_module("route_probe.endpoint")
    edges = _trace(lambda: endpoint.Endpoint().run(), "route_probe.")
    assert edges == {
        ("route_probe.driver", "route_probe.endpoint"): "call",
        ("route_probe.endpoint", "route_probe.driver"): "import",
    }
    assert find_cycle(edges) == [
        "route_probe.driver -(call)->",
        "route_probe.endpoint -(import)->",
        "route_probe.driver",
    ]
