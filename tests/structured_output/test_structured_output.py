"""Structured outputs, the pieces: spec checks, the compiled-grammar cache (off the event loop,
time limit, errors that name the problem), the engine-side matchers (bitmask rows, accepted
tokens, termination, rollback) and WAITING_FOR_GRAMMAR in both scheduler twins."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest
import trio
from scheduler_twin_helpers import IMPL_NAMES, FakeWorker, get_impl, make_scheduler

from trillm.core.request import RequestStatus
from trillm.messages import EngineCoreRequest, SchedulerOutput
from trillm.sampling_params import SamplingParams, SamplingParamsError, StructuredOutputsParams
from trillm.structured_output import (
    GrammarCache,
    StructuredOutputError,
    StructuredOutputManager,
    check_params,
)
from trillm.structured_output.spec import (
    MAX_GRAMMAR_CHARS,
    MAX_JSON_DEPTH,
    MAX_REGEX_CHARS,
    MAX_SCHEMA_NODES,
    json_depth,
    json_shape,
)

SO = StructuredOutputsParams
SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "n": {"enum": [1, 2, 3]}},
    "required": ["ok", "n"],
}


def deep_schema_text(levels: int) -> str:
    return '{"type": "object", "properties": {"x": ' * levels + '{"type": "string"}' + "}}" * levels


def deep_schema(levels: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"x": schema}}
    return schema


@pytest.fixture(scope="module")
def tokenizer():
    from trillm.engine.tokenizer_loader import load_tokenizer
    from trillm.testing.tiny_models import DEFAULT_MODEL_DIR

    return load_tokenizer(str(DEFAULT_MODEL_DIR))


@pytest.fixture(scope="module")
def cache(tokenizer):
    # 4133: a model vocabulary larger than the tokenizer's (padded embeddings)
    return GrammarCache(tokenizer, 4133, [2, 0])


# ---------------------------------------------------------------- spec checks


@pytest.mark.parametrize(
    ("kwargs", "param", "match"),
    [
        ({}, "structured_outputs", "exactly one"),
        ({"regex": "a", "choice": ["a"]}, "structured_outputs", "exactly one"),
        ({"choice": []}, "structured_outputs.choice", "non-empty"),
        ({"choice": ["a", 3]}, "structured_outputs.choice", "strings"),
        ({"json": "{not json"}, "structured_outputs.json", "not valid JSON"),
        ({"json": "[1, 2]"}, "structured_outputs.json", "JSON object"),
        ({"json": 5}, "structured_outputs.json", "object or a string"),
        ({"json": deep_schema(600)}, "structured_outputs.json", "nests deeper"),
        ({"json": deep_schema_text(600)}, "structured_outputs.json", "nests deeper"),
        ({"json_object": False}, "structured_outputs.json_object", "true"),
        ({"regex": 5}, "structured_outputs.regex", "string"),
        ({"structural_tag": "{"}, "structured_outputs.structural_tag", "not valid JSON"),
        # the compile-cost bounds, each one past its limit
        ({"regex": "a" * (MAX_REGEX_CHARS + 1)}, "structured_outputs.regex", "limit of 16384"),
        ({"grammar": "x" * (MAX_GRAMMAR_CHARS + 1)}, "structured_outputs.grammar", "limit"),
        ({"choice": ["a" * 40_000, "b" * 40_000]}, "structured_outputs.choice", "in all"),
        ({"json": {"enum": list(range(MAX_SCHEMA_NODES))}}, "structured_outputs.json", "values"),
        (
            {"json": json.dumps({"properties": {str(i): {} for i in range(257)}})},
            "structured_outputs.json",
            "257 properties",
        ),
        (
            {
                "json": {
                    "properties": {
                        f"o{j}": {"properties": dict.fromkeys(range(250), {})} for j in range(9)
                    }
                }
            },
            "structured_outputs.json",
            "properties in all",
        ),
        (
            {"structural_tag": {"structures": [{"begin": "<a>", "end": "</a>"}] * 5000}},
            "structured_outputs.structural_tag",
            "values",
        ),
    ],
)
def test_malformed_specs_are_refused_when_built(kwargs, param, match):
    with pytest.raises(SamplingParamsError, match=match) as info:
        SO(**kwargs)
    assert info.value.param == param


def test_a_very_deep_schema_is_refused_without_recursion():
    # Deeper than Python's recursion limit: the check itself must not recurse.
    value: list = []
    for _ in range(100_000):
        value = [value]
    assert json_depth(value) > MAX_JSON_DEPTH
    text = "[" * 100_000 + "]" * 100_000
    with pytest.raises(SamplingParamsError, match="nests deeper"):
        SO(json='{"a": ' + text + "}")


def test_a_huge_schema_is_counted_only_up_to_its_bound():
    """json_shape stops at the bound: a schema of 2,000,000 values costs what 10,000 do."""
    huge = {"enum": list(range(2_000_000))}
    start = time.thread_time()
    _, nodes, _, _ = json_shape(huge)
    took = time.thread_time() - start
    assert MAX_SCHEMA_NODES < nodes and took < 0.05, (nodes, took)
    ordinary = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(200)}}
    assert json_shape(ordinary) == (3, 403, 200, 200)


def test_spec_key_and_options():
    assert check_params(SO(json=SCHEMA)) == check_params(SO(json=json.dumps(SCHEMA)))
    assert check_params(SO(json=SCHEMA)) != check_params(
        SO(json=SCHEMA, disable_any_whitespace=True)
    )
    spec = check_params(SO(json=SCHEMA, disable_additional_properties=True))
    assert json.loads(spec.text)["additionalProperties"] is False
    explicit = {**SCHEMA, "additionalProperties": True}
    spec = check_params(SO(json=explicit, disable_additional_properties=True))
    assert json.loads(spec.text)["additionalProperties"] is True  # what the schema says wins


# ---------------------------------------------------------------- compiling


@pytest.mark.parametrize(
    ("so", "match"),
    [
        (SO(regex="a("), "Invalid regex: .*parenthesis"),
        (SO(json={"type": "foo"}), 'Invalid JSON schema: Unsupported type "foo"'),
        (SO(json={"$ref": "#/nope"}), "Invalid JSON schema"),
        (SO(grammar='root ::= "a" | undefined_rule'), "Invalid grammar: .*undefined_rule"),
        (SO(grammar="start: (("), "Invalid grammar"),
        (
            SO(structural_tag={"type": "structural_tag", "format": {"type": "nope"}}),
            "Invalid structural tag",
        ),
    ],
)
def test_invalid_specs_name_the_problem(cache, so, match):
    async def main():
        with pytest.raises(StructuredOutputError, match=match) as info:
            await cache.compile(check_params(so))
        assert info.value.param == f"structured_outputs.{check_params(so).kind}"
        assert "/project/cpp" not in str(info.value)  # xgrammar's source path is stripped

    trio.run(main)


def test_cache_compiles_each_spec_once_and_off_the_event_loop(cache):
    async def main():
        spec = check_params(SO(regex="[0-9]{4}"))
        before = cache.num_compiles
        ticks = 0

        async def ticker():
            nonlocal ticks
            while True:
                ticks += 1
                await trio.lowlevel.checkpoint()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(ticker)
            first = await cache.compile(spec)
            nursery.cancel_scope.cancel()
        assert ticks > 0  # the loop ran while the thread compiled
        assert await cache.compile(spec) is first
        assert cache.get(spec) is first
        assert cache.num_compiles == before + 1

    trio.run(main)


def test_compile_time_limit(tokenizer, monkeypatch):
    slow = GrammarCache(tokenizer, 4096, [2])
    real = slow.compile_now

    def sluggish(spec):
        time.sleep(0.5)
        return real(spec)

    monkeypatch.setattr(slow, "compile_now", sluggish)

    async def main():
        spec = check_params(SO(regex="x+"))
        with pytest.raises(StructuredOutputError, match="took longer than 0.05 s"):
            await slow.compile(spec, timeout_s=0.05)
        await trio.sleep(0.6)  # it finished in the background, and is cached
        assert slow.get(spec) is not None

    trio.run(main)
    slow.close()


# ---------------------------------------------------------------- matchers


def _sched(step_id: int, req_ids: list[str]) -> SchedulerOutput:
    from trillm.messages import CachedRequestData

    return SchedulerOutput(
        step_id,
        [],
        CachedRequestData(),
        {r: 1 for r in req_ids},
        len(req_ids),
        wait_for_bitmask=True,
    )


def _allowed(row: bytes, vocab: int) -> list[int]:
    words = np.frombuffer(row, dtype=np.uint32)
    bits = (words[:, None] >> np.arange(32, dtype=np.uint32)) & 1
    return [int(t) for t in np.flatnonzero(bits.reshape(-1)) if t < vocab]


def test_matcher_bitmask_accept_terminate_rollback(cache, tokenizer):
    manager = StructuredOutputManager(cache)
    trio.run(cache.compile, check_params(SO(choice=["yes", "no"])))
    assert manager.add_request("a", SO(choice=["yes", "no"]))  # compiled: ready now
    assert manager.num_words == -(-4133 // 32)
    req = manager.fill_bitmask(_sched(1, ["a", "plain"]), lambda r: True)
    assert list(req.bitmask) == ["a"]  # unconstrained requests have no row
    row = req.bitmask["a"]
    assert isinstance(row, bytes) and len(row) == 4 * manager.num_words
    allowed = _allowed(row, 4133)
    assert allowed and all(t < len(tokenizer) for t in allowed)  # padding never allowed
    assert all("yes".startswith(s) or "no".startswith(s) for s in map(tokenizer.decode, allowed))
    ids = tokenizer.encode("yes", add_special_tokens=False)
    assert manager.accept_tokens("a", ids) == (True, False)
    manager.rollback("a", len(ids))  # back to the start: "no" is possible again
    no_ids = tokenizer.encode("no", add_special_tokens=False)
    assert manager.accept_tokens("a", no_ids) == (True, False)
    assert _allowed(manager.fill_bitmask(_sched(2, ["a"]), lambda r: True).bitmask["a"], 4133) == [
        0,
        2,
    ]
    assert manager.accept_tokens("a", [2]) == (True, True)  # EOS: terminated
    assert manager.fill_bitmask(_sched(3, ["a"]), lambda r: True).bitmask == {}
    manager.retain(lambda r: False)
    assert not manager.matchers


def test_token_outside_the_grammar_is_reported(cache, tokenizer):
    manager = StructuredOutputManager(cache)
    trio.run(cache.compile, check_params(SO(regex="[0-9]+")))
    assert manager.add_request("d", SO(regex="[0-9]+"))
    ok, terminated = manager.accept_tokens("d", tokenizer.encode("x", add_special_tokens=False))
    assert (ok, terminated) == (False, False)


def test_rows_only_for_requests_that_sample(cache):
    manager = StructuredOutputManager(cache)
    trio.run(cache.compile, check_params(SO(regex="[ab]+")))
    for r in ("p", "q"):
        assert manager.add_request(r, SO(regex="[ab]+"))
    req = manager.fill_bitmask(_sched(1, ["p", "q"]), lambda r: r == "q")
    assert list(req.bitmask) == ["q"]


def test_pending_grammar_is_polled(cache):
    manager = StructuredOutputManager(cache)
    so = SO(regex="[xyz]{3}q")
    assert not manager.add_request("w", so)  # not compiled yet
    assert manager.has_pending
    deadline = time.monotonic() + 30
    ready: list[str] = []
    while not ready and time.monotonic() < deadline:
        ready, failed = manager.poll()
        assert not failed
        time.sleep(0.01)
    assert ready == ["w"] and "w" in manager.matchers and not manager.has_pending
    assert not manager.add_request("bad", SO(regex="(("))
    while manager.has_pending:
        ready, failed = manager.poll()
        time.sleep(0.01)
    assert failed and failed[0][0] == "bad" and "Invalid regex" in failed[0][1]


# ---------------------------------------------------------------- scheduler twins


@pytest.fixture(params=IMPL_NAMES)
def impl(request):
    return get_impl(request.param)


def _req(req_id: str, structured: bool) -> EngineCoreRequest:
    so = SO(regex="a+") if structured else None
    params = SamplingParams(max_tokens=3, structured_outputs=so)
    return EngineCoreRequest(req_id, [1, 2, 3], params, 0.0)


def test_waiting_for_grammar_does_not_block_others(impl):
    sched = make_scheduler(impl)
    sched.add_request(_req("g", True))
    sched.set_waiting_for_grammar("g")
    sched.add_request(_req("p", False))
    assert sched.get_request("g").status == RequestStatus.WAITING_FOR_GRAMMAR
    out = sched.schedule()
    assert list(out.num_scheduled_tokens) == ["p"] and not out.wait_for_bitmask
    assert sched.waiting_req_ids() == ["g"] and sched.has_unfinished_requests()
    sched.update_from_output(out, FakeWorker().execute(out))
    assert list(sched.schedule().num_scheduled_tokens) == ["p"]  # g still waits
    sched.grammar_ready("g")
    assert sched.get_request("g").status == RequestStatus.WAITING
    out = sched.schedule()
    assert "g" in out.num_scheduled_tokens and out.wait_for_bitmask


def test_waiting_for_grammar_can_be_aborted(impl):
    sched = make_scheduler(impl)
    sched.add_request(_req("g", True))
    sched.set_waiting_for_grammar("g")
    from trillm.messages import FinishReason

    sched.finish_requests(["g"], FinishReason.ABORT)
    assert not sched.has_unfinished_requests()
    assert sched.schedule().total_num_scheduled_tokens == 0
    sched.grammar_ready("g")  # unknown by now: ignored


def test_only_waiting_requests_wait_for_grammar(impl):
    sched = make_scheduler(impl)
    sched.add_request(_req("r", True))
    sched.schedule()
    sched.set_waiting_for_grammar("r")  # running already: no effect
    assert sched.get_request("r").status == RequestStatus.RUNNING


def _summary(out: SchedulerOutput) -> tuple:
    return (
        dict(out.num_scheduled_tokens),
        [r.req_id for r in out.scheduled_new_reqs],
        list(out.finished_req_ids),
        out.wait_for_bitmask,
    )


@pytest.mark.parametrize("seed", range(4))
def test_twins_agree_with_grammar_waits(seed):
    """Differential: random arrivals (some waiting for their grammar), grammars becoming
    ready, aborts, under KV pressure (preemptions), policies fcfs and priority: the native
    and Python schedulers hand out the same steps."""
    import random

    from scheduler_twin_helpers import check_scheduler_invariants

    from trillm.messages import FinishReason
    from trillm.sampling_params import SamplingParams as SP

    policy = "priority" if seed % 2 else "fcfs"
    twins = [
        make_scheduler(get_impl(name), num_blocks=24, max_num_seqs=6, policy=policy)
        for name in IMPL_NAMES
    ]
    workers = [FakeWorker(seed=seed) for _ in twins]
    rng = random.Random(seed)
    live: list[str] = []
    waiting_grammar: list[str] = []
    for step in range(150):
        for _ in range(rng.choice((0, 0, 1, 2))):
            rid = f"r{step}-{rng.randrange(1000)}"
            structured = rng.random() < 0.5
            params = SP(
                max_tokens=rng.randint(1, 12),
                structured_outputs=SO(regex="a+") if structured else None,
            )
            prompt = [rng.randrange(50) for _ in range(rng.randint(1, 20))]
            req = EngineCoreRequest(rid, prompt, params, float(step), priority=rng.randrange(3))
            for sched in twins:
                sched.add_request(req)
            if structured and rng.random() < 0.7:
                for sched in twins:
                    sched.set_waiting_for_grammar(rid)
                waiting_grammar.append(rid)
            live.append(rid)
        if waiting_grammar and rng.random() < 0.3:
            rid = waiting_grammar.pop(rng.randrange(len(waiting_grammar)))
            for sched in twins:
                sched.grammar_ready(rid)
        if live and rng.random() < 0.1:
            rid = live.pop(rng.randrange(len(live)))
            for sched in twins:
                sched.finish_requests([rid], FinishReason.ABORT)
        outs = [sched.schedule() for sched in twins]
        assert _summary(outs[0]) == _summary(outs[1]), step
        assert [s.waiting_req_ids() for s in twins][0] == twins[1].waiting_req_ids()
        results = []
        for sched, worker, out in zip(twins, workers, outs, strict=True):
            results.append(sched.update_from_output(out, worker.execute(out)))
            check_scheduler_invariants(sched, worker)
        assert [(o.request_id, o.finish_reason) for o in results[0]] == [
            (o.request_id, o.finish_reason) for o in results[1]
        ]
        statuses = [[s.get_request(r).status for r in s.waiting_req_ids()] for s in twins]
        assert statuses[0] == statuses[1]


def test_bitmask_rows_cross_the_codec_compactly():
    """SampleRequest rows are msgpack bin (the int32 words' bytes), not lists of ints."""
    from trillm.ipc import codec
    from trillm.messages import SampleRequest

    # 128 words (a 4096-token vocabulary) of mixed bits, as grammar masks are
    words = np.random.default_rng(0).integers(-(2**31), 2**31, 128).astype(np.int32)
    rows = {f"req-{i}": np.roll(words, i).tobytes() for i in range(64)}
    frame = codec.encode(SampleRequest(7, rows))
    back = codec.decode(frame)
    assert isinstance(back, SampleRequest) and back.step_id == 7 and back.bitmask == rows
    assert len(frame) < 64 * (4 * 128 + 16)  # ~4 bytes a word, plus a few per row
    as_lists = codec.encode(
        SampleRequest(7, {k: np.frombuffer(v, np.int32).tolist() for k, v in rows.items()})
    )
    assert len(frame) < len(as_lists)
