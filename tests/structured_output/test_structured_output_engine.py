"""Structured outputs through the engine and the Python API (``trillm.LLM``, ``open_engine``)
on a tiny random model: the grammar, not the model, decides, so every output validates (JSON
schema, regex, choice, EBNF), greedy and sampled, n > 1, mixed in one batch with
unconstrained requests. Also: no bitmask traffic for unconstrained steps, bitmask rows cross
the worker ring as bytes, a request waiting for its grammar holds nobody back, and a grammar
that fails in the engine ends its request alone."""

from __future__ import annotations

import json
import re
import time

import jsonschema
import pytest
import trio

from trillm import LLM, SamplingParams, open_engine
from trillm.executor.abstract import FAKE_RUNNER
from trillm.messages import EngineCoreRequest, FinishReason, SampleRequest
from trillm.sampling_params import SamplingParamsError, StructuredOutputsParams
from trillm.structured_output import StructuredOutputError

SO = StructuredOutputsParams
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "pets": {"type": "array", "items": {"enum": ["cat", "dog"]}, "maxItems": 3},
        "kind": {"enum": ["a", "b"]},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "pets", "kind", "ok"],
}
REGEX = r"[0-9]{3}-[a-z]{2,4}(\.[A-Z])?"
CHOICES = ["red", "green", "blue ocean", 'say "hi"']
EBNF = 'root ::= "(" num ("," num)* ")"\nnum ::= [1-9] [0-9]? | "0"'
EBNF_RE = r"\((?:[1-9][0-9]?|0)(?:,(?:[1-9][0-9]?|0))*\)"

# (params, check(text)): each kind with a validator that does not trust the engine.
CASES = {
    "json": (
        SO(json=PERSON, disable_any_whitespace=True),
        lambda t: jsonschema.validate(json.loads(t), PERSON),
    ),
    "json_text_ws": (
        SO(json=json.dumps(PERSON)),
        lambda t: jsonschema.validate(json.loads(t), PERSON),
    ),
    # NOTE: any JSON object: its strings are unbounded, so the test biases '"' and '}' (the
    # bias applies after the grammar's mask) for the random model to close them.
    "json_object": (
        SO(json_object=True, disable_any_whitespace=True),
        lambda t: _assert(isinstance(json.loads(t), dict)),
    ),
    "regex": (SO(regex=REGEX), lambda t: _assert(re.fullmatch(REGEX, t))),
    "choice": (SO(choice=CHOICES), lambda t: _assert(t in CHOICES)),
    "grammar": (SO(grammar=EBNF), lambda t: _assert(re.fullmatch(EBNF_RE, t))),
}


def _assert(ok) -> None:
    assert ok


@pytest.fixture(scope="module")
def model_path(tiny_model_factory):
    # NOTE: a model vocabulary larger than the tokenizer's: the bitmask is padded.
    return tiny_model_factory("llama", vocab_size=4133)


@pytest.fixture(scope="module")
def fake_model_path(tiny_model_factory):
    # The fake runner samples over the model's whole vocabulary: no padded ids here.
    return tiny_model_factory("llama")


@pytest.fixture(scope="module")
def llm(model_path):
    engine = LLM(
        model_path, max_model_len=1024, kv_cache_memory="32MiB", distributed_executor_backend="uni"
    )
    yield engine
    engine.shutdown()


def _check(kind: str, out) -> None:
    _, validate = CASES[kind]
    for c in out.outputs:
        if kind == "json_text_ws" and c.finish_reason == "length":
            # NOTE: vLLM's default lets JSON have any whitespace between tokens, and a random
            # model may spend max_tokens on it (the reason for disable_any_whitespace): the
            # only case where "length" is accepted; what came out is still JSON so far.
            assert c.text.lstrip().startswith("{"), c.text
            continue
        assert c.finish_reason == "stop", (kind, c.text)
        validate(c.text)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_every_kind_validates_in_one_mixed_batch(llm, temperature):
    kinds = list(CASES)
    tok = llm.get_tokenizer()
    closers = {tok.encode(c, add_special_tokens=False)[0]: 8.0 for c in ('"', "}")}
    params = [
        SamplingParams(
            temperature=temperature,
            max_tokens=400,
            seed=i,
            n=1 if i % 2 else 2,
            structured_outputs=CASES[k][0],
            logit_bias=closers if k == "json_object" else None,
        )
        for i, k in enumerate(kinds)
    ]
    plain = SamplingParams(temperature=temperature, max_tokens=20, ignore_eos=True)
    # The padded ids (4096..4132) have no text (the grammar's rows never allow them): a
    # neighbour sampling only those gets empty text and harms nobody.
    padded = SamplingParams(
        temperature=temperature,
        max_tokens=20,
        ignore_eos=True,
        allowed_token_ids=list(range(4096, 4133)),
    )
    prompts = [f"Answer {k}:" for k in kinds] + ["plain one", "plain two"]
    outs = llm.generate(prompts, params + [plain, padded], use_tqdm=False)
    for kind, out in zip(kinds, outs, strict=False):
        _check(kind, out)
    for out in outs[len(kinds) :]:  # the unconstrained neighbours are untouched
        assert out.outputs[0].finish_reason == "length"
        assert len(out.outputs[0].token_ids) == 20
    assert outs[-1].outputs[0].text == ""
    assert all(t >= 4096 for t in outs[-1].outputs[0].token_ids)


def test_many_sampled_json_outputs_validate(llm):
    params = SamplingParams(
        temperature=1.2, max_tokens=400, n=6, seed=3, structured_outputs=CASES["json"][0]
    )
    outs = llm.generate(["a", "b", "c"], params, use_tqdm=False)
    for out in outs:
        _check("json", out)
    texts = {c.text for out in outs for c in out.outputs}
    assert len(texts) > 1  # sampling still samples, within the grammar


def test_invalid_specs_raise_value_error_and_the_engine_goes_on(fake_model_path):
    with pytest.raises(SamplingParamsError, match="exactly one"):
        SamplingParams(structured_outputs=SO(regex="a", choice=["a"]))

    async def main():
        async with open_engine(
            fake_model_path, runner=FAKE_RUNNER, distributed_executor_backend="uni"
        ) as engine:
            for so, match in [
                (SO(regex="[z-a]"), "Invalid regex"),
                (SO(json={"type": "object", "properties": {"a": {"type": "nope"}}}), "nope"),
                (SO(grammar="root ::= missing"), "missing"),
            ]:
                with pytest.raises(StructuredOutputError, match=match) as info:
                    stream = engine.generate("x", SamplingParams(structured_outputs=so))
                    async with stream as outputs:
                        async for _ in outputs:
                            pass
                assert isinstance(info.value, ValueError)
                assert info.value.param.startswith("structured_outputs.")
            assert engine.cores[0].scheduler.get_stats().num_waiting_reqs == 0  # never submitted
            params = SamplingParams(max_tokens=50, structured_outputs=SO(choice=["ok", "fine"]))
            async with engine.generate("x", params) as outputs:
                async for out in outputs:
                    pass
            # ignore_eos: the scheduler does not stop at EOS, the terminated grammar does
            params = SamplingParams(
                max_tokens=50, ignore_eos=True, structured_outputs=SO(choice=["ok", "fine"])
            )
            async with engine.generate("y", params) as outputs:
                async for out2 in outputs:
                    pass
            return out, out2

    for out in trio.run(main):
        assert out.outputs[0].text in ("ok", "fine") and out.outputs[0].finish_reason == "stop"


def test_streaming_deltas_concatenate_to_valid_json(model_path):
    from trillm.sampling_params import RequestOutputKind

    async def main():
        async with open_engine(
            model_path,
            max_model_len=1024,
            kv_cache_memory="16MiB",
            distributed_executor_backend="uni",
        ) as engine:
            params = SamplingParams(
                temperature=0.8,
                seed=1,
                max_tokens=400,
                output_kind=RequestOutputKind.DELTA,
                structured_outputs=CASES["json"][0],
            )
            pieces, last = [], None
            async with engine.generate("stream:", params) as outputs:
                async for out in outputs:
                    pieces.append(out.outputs[0].text)
                    last = out
            return pieces, last

    pieces, last = trio.run(main)
    assert len(pieces) > 3 and last.outputs[0].finish_reason == "stop"
    jsonschema.validate(json.loads("".join(pieces)), PERSON)


# ---------------------------------------------------------------- transport (fake model)


def test_bitmask_only_for_steps_with_a_constrained_request(fake_model_path):
    """Through the worker subprocess and its ring: no SampleRequest while only unconstrained
    requests run; with a constrained one, one bytes row per constrained sampling request."""
    seen: list[SampleRequest | None] = []

    async def main():
        async with open_engine(
            fake_model_path,
            runner=FAKE_RUNNER,
            distributed_executor_backend="mp",
            runner_kwargs={"step_sleep_s": 0.002},
        ) as engine:
            executor = engine.cores[0].executor
            real = executor.sample_tokens

            async def spy(req):
                seen.append(req)
                return await real(req)

            executor.sample_tokens = spy
            plain = SamplingParams(max_tokens=6, ignore_eos=True)
            async with engine.generate("plain", plain) as outputs:
                async for _ in outputs:
                    pass
            n_plain = len(seen)
            assert n_plain >= 6 and all(r is None for r in seen)
            constrained = SamplingParams(max_tokens=60, structured_outputs=SO(regex="[a-f]{5}"))
            results = {}

            async def one(name, params):
                async with engine.generate(name, params, name) as outputs:
                    async for out in outputs:
                        results[name] = out

            async with trio.open_nursery() as nursery:
                nursery.start_soon(one, "c", constrained)
                nursery.start_soon(one, "p", SamplingParams(max_tokens=200, ignore_eos=True))
            return n_plain, results

    n_plain, results = trio.run(main)
    assert re.fullmatch("[a-f]{5}", results["c"].outputs[0].text)
    assert results["c"].outputs[0].finish_reason == "stop"
    with_mask = [r for r in seen[n_plain:] if r is not None and r.bitmask]
    assert with_mask and all(list(r.bitmask) == ["c"] for r in with_mask)
    assert all(isinstance(row, bytes) for r in with_mask for row in r.bitmask.values())
    assert seen[-1] is None  # "c" ended: the steps of "p" alone carry no bitmask


def test_waiting_for_grammar_holds_nobody_back_and_a_failed_grammar_ends_alone(
    fake_model_path, monkeypatch
):
    """Requests reaching the engine core uncompiled (the frontend is bypassed): they wait in
    WAITING_FOR_GRAMMAR while others run; a grammar that fails there aborts its request only."""

    async def main():
        async with open_engine(
            fake_model_path, runner=FAKE_RUNNER, distributed_executor_backend="uni"
        ) as engine:
            core = engine.cores[0]
            cache = core.structured_output.cache
            real = cache.compile_now

            def slow(spec):
                time.sleep(0.5)
                return real(spec)

            monkeypatch.setattr(cache, "compile_now", slow)
            tok = engine.tokenizer
            so = SO(regex="x{3}y")
            prompt = tok.encode("go")
            core.handle_input(
                EngineCoreRequest(
                    "g",
                    prompt,
                    SamplingParams(max_tokens=20, structured_outputs=so),
                    0.0,
                    eos_token_id=2,
                )
            )
            core.handle_input(
                EngineCoreRequest(
                    "bad",
                    prompt,
                    SamplingParams(max_tokens=20, structured_outputs=SO(regex="((")),
                    0.0,
                )
            )
            mutated = SO(regex="a")
            mutated.regex = 5  # type: ignore[assignment]  # changed after its checks
            core.handle_input(
                EngineCoreRequest(
                    "mut", prompt, SamplingParams(max_tokens=5, structured_outputs=mutated), 0.0
                )
            )
            core.handle_input(
                EngineCoreRequest("p", prompt, SamplingParams(max_tokens=5, ignore_eos=True), 0.0)
            )
            done: dict[str, list[int]] = {}
            reasons: dict[str, FinishReason] = {}
            order = []
            t0 = time.monotonic()
            while len(reasons) < 4 and time.monotonic() - t0 < 30:
                result = await core.step()
                if result is None:
                    await trio.sleep(0.01)
                    continue
                for o in result.outputs:
                    done.setdefault(o.request_id, []).extend(o.new_token_ids)
                    if o.finish_reason is not None:
                        reasons[o.request_id] = o.finish_reason
                        order.append((o.request_id, time.monotonic() - t0))
            return tok, done, reasons, order

    tok, done, reasons, order = trio.run(main)
    assert reasons == {
        "p": FinishReason.LENGTH,
        "bad": FinishReason.ABORT,
        "g": FinishReason.STOP,
        "mut": FinishReason.ABORT,
    }
    first = [r for r, _ in order if r != "mut"][0]  # ("mut" is refused at once)
    assert first == "p" and dict(order)["p"] < 0.5  # it did not wait for the compiles
    assert tok.decode(done["g"], skip_special_tokens=True) == "xxxy"


def test_structural_tag(llm):
    """A structural tag (xgrammar's format): a tagged JSON payload, nothing else."""
    payload = {"type": "object", "properties": {"x": {"enum": [1, 2]}}, "required": ["x"]}
    tag = {
        "type": "structural_tag",
        "format": {
            "type": "tag",
            "begin": "<call>",
            "end": "</call>",
            "content": {"type": "json_schema", "json_schema": payload},
        },
    }
    params = SamplingParams(
        temperature=1.0,
        seed=4,
        n=3,
        max_tokens=200,
        structured_outputs=SO(structural_tag=tag),
    )
    (out,) = llm.generate("call:", params, use_tqdm=False)
    for c in out.outputs:
        m = re.fullmatch(r"<call>(.*)</call>", c.text, re.S)
        assert m and c.finish_reason == "stop", c.text
        jsonschema.validate(json.loads(m.group(1)), payload)
