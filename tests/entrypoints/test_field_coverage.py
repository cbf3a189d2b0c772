"""Honour or refuse, checked: every request field, SamplingParams / EngineArgs field and
``trillm serve`` flag is mapped to tests that show its effect or its refusal (issue 12).

The fields are walked, not listed: every attrs class reachable from the request models in
``trillm/entrypoints/openai/schemas/protocol.py``, the dataclasses reachable from ``SamplingParams``,
``EngineArgs``, and the argparse actions of ``trillm serve``. Each must appear in exactly one
of COVERAGE (test node ids; each test was read to confirm it observes the field's effect or
its refusal, not just acceptance), NO_EFFECT_BY_DESIGN (reason given; vLLM does the same) or
KNOWN_GAPS (accepted but not honoured yet: the strict xfail below lists them until fixed).

A new field or flag fails ``test_every_field_and_flag_is_mapped`` until someone maps it to a
test that shows what it does; an entry whose test is gone, or that names a field that is
gone, fails too.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
import re
import typing
from pathlib import Path

import attrs
import pytest
from field_coverage_table import COVERAGE, KNOWN_GAPS, NO_EFFECT_BY_DESIGN

REPO = Path(__file__).resolve().parents[2]


# ---------------------------------------------------------------- what exists


def _nested_types(tp: typing.Any) -> list[typing.Any]:
    found, stack = [], [tp]
    while stack:
        t = stack.pop()
        if attrs.has(t) or dataclasses.is_dataclass(t):
            found.append(t)
        stack.extend(typing.get_args(t))
    return found


def _walk(root: type, seen: dict[type, None]) -> None:
    if root in seen:
        return
    seen[root] = None
    if attrs.has(root):
        names = [f.name for f in attrs.fields(root)]
    else:
        names = [f.name for f in dataclasses.fields(root)]
    hints = typing.get_type_hints(root)
    for name in names:
        for nested in _nested_types(hints[name]):
            _walk(nested, seen)


def _fields(*roots: type) -> set[str]:
    seen: dict[type, None] = {}
    for root in roots:
        _walk(root, seen)
    keys = set()
    for cls in seen:
        fields = attrs.fields(cls) if attrs.has(cls) else dataclasses.fields(cls)
        keys |= {f"{cls.__name__}.{f.name}" for f in fields}
    return keys


# flag key -> all its spellings (option strings, or the positional's metavar and dest)
FLAG_SPELLINGS: dict[str, list[str]] = {}


def serve_flags() -> set[str]:
    """Each ``trillm serve`` option by its first long name; a positional by its metavar."""
    from trillm.entrypoints.cli.main import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    for action in sub.choices["serve"]._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        longs = [o for o in action.option_strings if o.startswith("--")]
        key = longs[0] if longs else (action.metavar or action.dest)
        FLAG_SPELLINGS[key] = list(action.option_strings) or [key, action.dest]
    return set(FLAG_SPELLINGS)


@functools.cache
def all_keys() -> frozenset[str]:
    from trillm.config import EngineArgs
    from trillm.entrypoints.openai.schemas import anthropic, pooling, protocol, responses, score
    from trillm.sampling_params import SamplingParams

    requests = _fields(
        protocol.ChatCompletionRequest,
        protocol.CompletionRequest,
        protocol.TokenizeRequest,
        protocol.DetokenizeRequest,
        responses.ResponsesRequest,
        pooling.EmbeddingRequest,
        pooling.PoolingRequest,
        pooling.ClassificationRequest,
        score.ScoreRequest,
        score.RerankRequest,
        anthropic.MessagesRequest,
        anthropic.CountTokensRequest,
    )
    return frozenset(requests | _fields(SamplingParams) | _fields(EngineArgs) | serve_flags())


# ---------------------------------------------------------------- the checks


def test_the_walk_finds_the_request_models_and_the_flags():
    keys = all_keys()
    for key in (
        "ChatCompletionRequest.messages",
        "CompletionRequest.prompt",
        "StreamOptions.include_usage",
        "NamedFunction.name",
        "TextPart.text",
        "StructuredOutputsParams.regex",
        "EngineArgs.block_size",
        "--block-size",
        "MODEL",
        "--enable-prefix-caching",
    ):
        assert key in keys, key


def test_every_field_and_flag_is_mapped():
    tables = (COVERAGE, NO_EFFECT_BY_DESIGN, KNOWN_GAPS)
    missing = sorted(k for k in all_keys() if not any(k in t for t in tables))
    assert not missing, (
        "Fields/flags no test shows the effect (or refusal) of; write a test and add it to "
        "its section in tests/support/field_coverage/ (request_fields, sampling_params, engine_args, "
        "serve_flags):\n  " + "\n  ".join(missing)
    )


def test_each_field_is_in_one_table_only():
    both = (set(COVERAGE) & set(NO_EFFECT_BY_DESIGN)) | (set(COVERAGE) & set(KNOWN_GAPS))
    both |= set(NO_EFFECT_BY_DESIGN) & set(KNOWN_GAPS)
    assert not both, sorted(both)


def test_no_stale_entries():
    stale = sorted(
        k for t in (COVERAGE, NO_EFFECT_BY_DESIGN, KNOWN_GAPS) for k in t if k not in all_keys()
    )
    assert not stale, f"Entries for fields/flags that no longer exist: {stale}"


def test_no_effect_by_design_stays_tiny_and_says_why():
    assert len(NO_EFFECT_BY_DESIGN) <= 8, "keep it tiny: honour the field or refuse it"
    for key, reason in {**NO_EFFECT_BY_DESIGN, **KNOWN_GAPS}.items():
        assert len(reason) > 40, (key, "say why, and what vLLM does")


@functools.cache
def _test_functions(path: str) -> dict[str, str]:
    """Test function name (``Class::name`` for methods) -> its source with decorators, plus the
    module-level constants it uses (the request bodies many tests keep there), two levels deep."""
    source = (REPO / path).read_text()
    lines = source.splitlines()
    tree = ast.parse(source)
    constants: dict[str, ast.AST] = {}
    for node in tree.body:
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                if isinstance(target, ast.Name):
                    constants[target.id] = node

    def text(node: ast.AST) -> str:
        start = min([d.lineno for d in getattr(node, "decorator_list", [])] + [node.lineno])
        return "\n".join(lines[start - 1 : node.end_lineno])  # type: ignore[attr-defined]

    def with_constants(node: ast.AST) -> str:
        parts, seen, frontier = [text(node)], set(), [node]
        for _ in range(2):
            used = {n.id for f in frontier for n in ast.walk(f) if isinstance(n, ast.Name)}
            frontier = [constants[u] for u in sorted(used - seen) if u in constants]
            seen |= used
            parts += [text(c) for c in frontier]
        return "\n".join(parts)

    out = {}

    def add(node: ast.AST, prefix: str) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            out[prefix + node.name] = with_constants(node)
        elif isinstance(node, ast.ClassDef):
            for child in node.body:
                add(child, prefix + node.name + "::")

    for node in tree.body:
        add(node, "")
    return out


@functools.cache
def _module_text(path: str) -> str:
    """A test module's source plus the tests/support helpers it imports, and theirs (the server
    harness)."""
    text, seen = (REPO / path).read_text(), set()
    pending = re.findall(r"^from (\w+) import", text, re.MULTILINE)
    while pending:
        candidate = REPO / "tests" / "support" / f"{pending.pop()}.py"
        if candidate.is_file() and candidate not in seen:
            seen.add(candidate)
            helper = candidate.read_text()
            text += helper
            pending += re.findall(r"^from (\w+) import", helper, re.MULTILINE)
    return text


def _words(key: str) -> list[str]:
    """What a test exercising ``key`` mentions: the field, or one of the flag's spellings
    (or the EngineArgs field it sets)."""
    all_keys()  # fills FLAG_SPELLINGS
    if key in FLAG_SPELLINGS:
        spellings = FLAG_SPELLINGS[key]
        return [*spellings, *(s[2:].replace("-", "_") for s in spellings if s.startswith("--"))]
    return [key.rsplit(".", 1)[1]]


@pytest.mark.parametrize("key", sorted(COVERAGE))
def test_entries_name_tests_that_exist_and_mention_the_field(key):
    """Every test named exists; at least one of them mentions the field (in the test or the
    constants it uses; for flags and engine arguments, in its module, where the fixtures
    that start servers and engines live)."""
    node_ids = COVERAGE[key]
    assert node_ids and isinstance(node_ids, tuple), key
    mentioned = False
    for node_id in node_ids:
        path, _, name = node_id.partition("::")
        assert (REPO / path).is_file(), f"{key}: no file {path}"
        name = name.split("[", 1)[0]  # a parametrized case: the function
        functions = _test_functions(path)
        assert name in functions, f"{key}: no test {name} in {path}"
        wide = key in FLAG_SPELLINGS or key.startswith("EngineArgs.")
        where = _module_text(path) if wide else functions[name]
        mentioned = mentioned or any(w in where for w in _words(key))
    assert mentioned, f"{key}: none of {node_ids} mentions it"


def test_known_gaps_are_closed():
    # Honour or refuse: a field accepted but not honoured is a defect, never a table entry.
    assert not KNOWN_GAPS, sorted(KNOWN_GAPS)
