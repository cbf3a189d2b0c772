"""Output processor: stop strings, hold-back, logprobs, collectors, output kinds, n > 1.

Engine outputs are built by hand (no engine needed); text expectations come from the real
tokenizer's ``decode`` and plain ``str`` operations, never from the code under test.
"""

from __future__ import annotations

import pytest
import trio
import trio.testing
from engine_outputs import TEXT, drain, ids_of, step
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from trillm.engine.detokenizer import load_native_module
from trillm.engine.logprobs import make_logprob_dict
from trillm.engine.output_collector import RequestOutputCollector
from trillm.engine.output_processor import OutputProcessor
from trillm.engine.stop_strings import StopStringMatcher
from trillm.errors import EngineDeadError
from trillm.messages import FinishReason, LogprobsLists
from trillm.outputs import Logprob, RequestOutput
from trillm.sampling_params import RequestOutputKind, SamplingParams

EOS = 2  # <|im_end|>
NATIVE_PARAMS = [
    False,
    pytest.param(
        True,
        marks=pytest.mark.skipif(load_native_module() is None, reason="native not built"),
    ),
]


@pytest.fixture(params=NATIVE_PARAMS, ids=["python", "native"])
def processor(request, tok):
    return OutputProcessor(tok, native=request.param)


def run_one_by_one(processor, ids, params, finish=FinishReason.LENGTH, req="r"):
    """Feeds ids one per step; returns every output the reader sees (reading each step)."""
    collector = processor.add_request(req, TEXT, [1, 5, 7], params)
    seen, aborts = [], []
    for i, token in enumerate(ids):
        last = i == len(ids) - 1
        aborts += processor.process_outputs([step(req, [token], finish if last else None)])
        seen += drain(collector)
    return seen, aborts


# ---------------------------------------------------------------- text and finishing


def test_cumulative_text_follows_decode(tok, processor):
    ids = ids_of(tok)
    seen, aborts = run_one_by_one(processor, ids, SamplingParams(max_tokens=len(ids)))
    assert aborts == []
    assert len(seen) == len(ids)
    for i, out in enumerate(seen):
        full = tok.decode(ids[: i + 1])
        # Final text only: an emoji split across tokens is not shown half-decoded.
        assert tok.decode(ids).startswith(out.outputs[0].text)
        if "\ufffd" not in full:
            assert out.outputs[0].text == full
        assert out.outputs[0].token_ids == ids[: i + 1]
    final = seen[-1]
    assert final.finished and final.outputs[0].text == tok.decode(ids)
    assert final.outputs[0].finish_reason == "length" and final.outputs[0].stop_reason is None
    assert final.prompt_token_ids == [1, 5, 7] and final.prompt == TEXT


@pytest.mark.parametrize("include", [False, True])
@pytest.mark.parametrize("skip", [True, False])
def test_eos_finish_and_special_tokens(tok, processor, skip, include):
    ids = ids_of(tok, "Hi there") + [EOS]
    params = SamplingParams(skip_special_tokens=skip, include_stop_str_in_output=include)
    seen, _ = run_one_by_one(processor, ids, params, finish=FinishReason.STOP)
    final = seen[-1].outputs[0]
    # As vLLM: the EOS that ended the sample has no text unless include_stop_str_in_output.
    shown = ids if include else ids[:-1]
    assert final.text == tok.decode(shown, skip_special_tokens=skip)
    assert final.token_ids == ids and final.finish_reason == "stop" and final.stop_reason is None


def test_stop_token_id_reason_passes_through(tok, processor):
    ids = ids_of(tok, "Hi there")
    collector = processor.add_request("s", None, [1], SamplingParams())
    processor.process_outputs([step("s", ids, FinishReason.STOP, stop_reason=ids[-1])])
    out = collector.get_nowait().outputs[0]
    assert out.stop_reason == ids[-1] and out.finish_reason == "stop"


def test_detokenize_false_gives_no_text(tok, processor):
    ids = ids_of(tok)
    params = SamplingParams(detokenize=False, stop=["fox"])
    seen, aborts = run_one_by_one(processor, ids, params)
    assert aborts == [] and all(o.outputs[0].text == "" for o in seen)
    assert seen[-1].outputs[0].token_ids == ids


# ---------------------------------------------------------------- stop strings


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_across_token_boundary(tok, processor, include):
    ids = ids_of(tok)
    stop = "x jum"
    pieces = [tok.decode([i]) for i in ids]
    assert not any(stop in p for p in pieces)  # it really spans tokens
    params = SamplingParams(stop=[stop], include_stop_str_in_output=include)
    seen, aborts = run_one_by_one(processor, ids, params)
    full = tok.decode(ids)
    cut = full.index(stop) + (len(stop) if include else 0)
    final = seen[-1]
    assert final.finished
    assert final.outputs[0].text == full[:cut]
    assert final.outputs[0].finish_reason == "stop" and final.outputs[0].stop_reason == stop
    # The token that completed the stop string is the last one kept.
    k = next(k for k in range(len(ids)) if stop in tok.decode(ids[: k + 1]))
    assert final.outputs[0].token_ids == ids[: k + 1]
    assert aborts == ["r"]  # the engine did not know; it must abort the request
    assert not processor.has_unfinished_requests()
    # Outputs for the aborted request that were already in flight are ignored.
    assert processor.process_outputs([step("r", ids[k + 1 : k + 2])]) == []


@pytest.mark.parametrize("stops", [["fox", "brown fox", "lazy"], ["lazy", "brown fox", "fox"]])
def test_first_completed_then_earliest_stop_string_wins(tok, processor, stops):
    """Both "fox" and "brown fox" complete with the token "x": the earlier start wins."""
    ids = ids_of(tok)
    seen, _ = run_one_by_one(processor, ids, SamplingParams(stop=stops))
    full = tok.decode(ids)
    final = seen[-1].outputs[0]
    assert final.stop_reason == "brown fox"
    assert final.text == full[: full.index("brown")]


def test_stop_string_in_one_multi_token_step_drops_later_tokens(tok, processor):
    ids = ids_of(tok)
    collector = processor.add_request("m", None, [1], SamplingParams(stop=[" over"]))
    aborts = processor.process_outputs([step("m", ids)])
    out = collector.get_nowait()
    k = next(k for k in range(len(ids)) if " over" in tok.decode(ids[: k + 1]))
    full = tok.decode(ids)
    assert aborts == ["m"] and out.finished
    assert out.outputs[0].token_ids == ids[: k + 1]
    assert out.outputs[0].text == full[: full.index(" over")]


def test_stop_string_when_engine_also_finishes_needs_no_abort(tok, processor):
    ids = ids_of(tok, "Hi there")
    collector = processor.add_request("e", None, [1], SamplingParams(stop=["there"]))
    aborts = processor.process_outputs([step("e", ids, FinishReason.LENGTH)])
    out = collector.get_nowait().outputs[0]
    assert aborts == [] and out.finish_reason == "stop" and out.text == "Hi "


def test_hold_back_never_streams_a_retracted_prefix(tok, processor):
    ids = ids_of(tok)
    stop = "lazy cat"  # " lazy" appears, then the text turns away: a partial match only
    params = SamplingParams(stop=[stop], output_kind=RequestOutputKind.DELTA)
    seen, _ = run_one_by_one(processor, ids, params)
    streamed = ""
    for i, out in enumerate(seen):
        streamed += out.outputs[0].text
        full_so_far = tok.decode(ids[: i + 1])
        if not out.finished and "\ufffd" not in full_so_far:
            # Exactly the hold-back of len(stop) - 1 characters is missing.
            assert streamed == full_so_far[: max(0, len(full_so_far) - (len(stop) - 1))]
    assert streamed == tok.decode(ids)


def test_hold_back_with_a_matching_stop_string_streams_only_the_kept_text(tok, processor):
    ids = ids_of(tok)
    stop = "the lazy"
    params = SamplingParams(stop=[stop], output_kind=RequestOutputKind.DELTA)
    seen, _ = run_one_by_one(processor, ids, params)
    full = tok.decode(ids)
    kept = full[: full.index(stop)]
    streamed = ""
    for out in seen:
        streamed += out.outputs[0].text
        assert kept.startswith(streamed)  # nothing after the cut was ever sent
    assert streamed == kept


def test_min_tokens_delays_stop_string_search(tok, processor):
    ids = ids_of(tok)
    params = SamplingParams(stop=["The"], min_tokens=3, max_tokens=len(ids))
    seen, aborts = run_one_by_one(processor, ids, params)
    assert aborts == [] and seen[-1].outputs[0].text == tok.decode(ids)


def test_stop_matcher_only_reports_matches_ending_in_new_text():
    m = StopStringMatcher(["ab", "xyz"], include_in_output=False)
    assert m.hold_back == 2
    assert m.find("..ab..", 5) is None  # "ab" ended before the new text
    assert m.find("..ab..x", 3) == ("ab", 2)
    assert StopStringMatcher(["ab"], True).find("zab", 2) == ("ab", 3)


# ---------------------------------------------------------------- logprobs


def test_logprob_dict_ranks_and_dedupe(tok):
    decode = lambda t: tok.decode([t])  # noqa: E731
    row = make_logprob_dict([7, 7, 9, 11], [-0.1, -0.1, -2.0, -3.0], 1, 2, decode)
    assert row == {7: Logprob(-0.1, 1, decode(7)), 9: Logprob(-2.0, 2, decode(9))}
    row = make_logprob_dict([5, 7, 9], [-4.0, -0.1, -2.0], 12, 2, decode)
    assert list(row) == [5, 7, 9] and row[5].rank == 12 and row[9].rank == 2
    assert make_logprob_dict([5, 7, 9], [-4.0, -0.1, -2.0], 12, 0, decode) == {
        5: Logprob(-4.0, 12, decode(5))
    }


def test_sample_and_prompt_logprobs(tok, processor):
    ids = ids_of(tok, "Hi there friend")
    n = len(ids)
    params = SamplingParams(logprobs=1, prompt_logprobs=1)
    collector = processor.add_request("l", None, [40, 41, 42], params)
    sample_lp = LogprobsLists(
        token_ids=[[t, 3, 4] for t in ids],  # sampled, top-1, top-2 (more than asked)
        logprobs=[[-0.5 * (i + 1), -0.01, -0.02] for i in range(n)],
        ranks=[i + 2 for i in range(n)],
    )
    prompt_lp = LogprobsLists(
        token_ids=[[41, 3], [42, 41]], logprobs=[[-1.0, -0.2], [-0.3, -0.3]], ranks=[5, 1]
    )
    processor.process_outputs(
        [step("l", ids, FinishReason.LENGTH, new_logprobs=sample_lp, new_prompt_logprobs=prompt_lp)]
    )
    out = collector.get_nowait()
    c = out.outputs[0]
    assert c.cumulative_logprob == pytest.approx(sum(-0.5 * (i + 1) for i in range(n)))
    assert len(c.logprobs) == n
    for i, pos in enumerate(c.logprobs):
        assert pos[ids[i]] == Logprob(-0.5 * (i + 1), i + 2, tok.decode([ids[i]]))
        assert pos[3] == Logprob(-0.01, 1, tok.decode([3]))
        assert 4 not in pos  # k = 1
    assert out.prompt_logprobs[0] is None
    assert out.prompt_logprobs[1] == {
        41: Logprob(-1.0, 5, tok.decode([41])),
        3: Logprob(-0.2, 1, tok.decode([3])),
    }
    assert out.prompt_logprobs[2] == {
        42: Logprob(-0.3, 1, tok.decode([42])),
        41: Logprob(-0.3, 1, tok.decode([41])),
    }


def test_no_logprobs_requested(tok, processor):
    ids = ids_of(tok, "Hi")
    seen, _ = run_one_by_one(processor, ids, SamplingParams())
    c = seen[-1].outputs[0]
    assert c.logprobs is None and c.cumulative_logprob is None and seen[-1].prompt_logprobs is None


def test_logprobs_truncated_with_the_tokens_at_a_stop_string(tok, processor):
    ids = ids_of(tok)
    lp = LogprobsLists([[t] for t in ids], [[-1.0] for _ in ids], [1 for _ in ids])
    collector = processor.add_request("t", None, [1], SamplingParams(stop=[" over"], logprobs=0))
    processor.process_outputs([step("t", ids, new_logprobs=lp)])
    c = collector.get_nowait().outputs[0]
    assert len(c.logprobs) == len(c.token_ids) < len(ids)
    assert c.cumulative_logprob == pytest.approx(-1.0 * len(c.token_ids))


# ---------------------------------------------------------------- output kinds, collectors


def test_final_only_gives_one_output(tok, processor):
    ids = ids_of(tok)
    params = SamplingParams(output_kind=RequestOutputKind.FINAL_ONLY, stop=["zzz"])
    seen, _ = run_one_by_one(processor, ids, params)
    assert len(seen) == 1 and seen[0].finished
    assert seen[0].outputs[0].text == tok.decode(ids)
    assert seen[0].outputs[0].token_ids == ids


@pytest.mark.parametrize("kind", [RequestOutputKind.DELTA, RequestOutputKind.CUMULATIVE])
def test_stalled_reader_gets_merged_outputs(tok, processor, kind):
    """A fast producer and a stalled consumer: one pending output, equal to the unmerged
    stream (DELTA: concatenated; CUMULATIVE: the latest)."""
    ids = ids_of(tok)
    params = SamplingParams(output_kind=kind, stop=["never"], logprobs=0)
    lp = lambda t: LogprobsLists([[t]], [[-0.25]], [1])  # noqa: E731
    reference = OutputProcessor(tok)
    ref_collector = reference.add_request("r", None, [1], params)
    collector = processor.add_request("r", None, [1], params)
    unmerged = []
    for i, t in enumerate(ids[:-1]):
        out = step("r", [t], new_logprobs=lp(t))
        reference.process_outputs([out])
        unmerged += drain(ref_collector)
        processor.process_outputs([out])
        if i == 5:  # the reader wakes up once in the middle, then stalls again
            first = collector.get_nowait()
    last = step("r", ids[-1:], FinishReason.LENGTH, new_logprobs=lp(ids[-1]))
    reference.process_outputs([last])
    unmerged += drain(ref_collector)
    processor.process_outputs([last])
    merged = drain(collector)
    assert len(merged) == 1 and merged[0].finished
    if kind == RequestOutputKind.DELTA:
        got = [first, merged[0]]
        for field in ("text", "token_ids", "logprobs"):
            join = (lambda xs: "".join(xs)) if field == "text" else (lambda xs: sum(xs, []))
            expect = join([getattr(o.outputs[0], field) for o in unmerged])
            assert join([getattr(o.outputs[0], field) for o in got]) == expect
    else:
        assert merged[0].outputs[0] == unmerged[-1].outputs[0]
    assert merged[0].outputs[0].cumulative_logprob == pytest.approx(-0.25 * len(ids))


def test_trio_reader_falls_behind_without_stalling_the_handler(tok):
    """The handler pushes every step without awaiting; a slow reader still sees everything."""
    ids = ids_of(tok) * 4
    processor = OutputProcessor(tok)
    params = SamplingParams(output_kind=RequestOutputKind.DELTA)
    collector = processor.add_request("t", None, [1], params)
    received: list[RequestOutput] = []

    async def reader():
        while True:
            out = await collector.get()
            received.append(out)
            if out.finished:
                return
            await trio.sleep(0.05)  # slower than the producer

    async def handler():
        for i, t in enumerate(ids):
            last = i == len(ids) - 1
            processor.process_outputs([step("t", [t], FinishReason.LENGTH if last else None)])
            await trio.sleep(0.01)

    async def main():
        async with trio.open_nursery() as nursery:
            nursery.start_soon(reader)
            nursery.start_soon(handler)

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    assert 1 < len(received) < len(ids)  # merged, but not all at once
    assert "".join(o.outputs[0].text for o in received) == tok.decode(ids)
    assert sum((o.outputs[0].token_ids for o in received), []) == ids
    assert received[-1].finished and received[-1].outputs[0].finish_reason == "length"


def test_collector_error_after_pending_output():
    collector = RequestOutputCollector(RequestOutputKind.DELTA)

    async def main():
        async with trio.open_nursery() as nursery:
            got = []

            async def reader():
                got.append(await collector.get())
                with pytest.raises(EngineDeadError, match="gone"):
                    await collector.get()

            nursery.start_soon(reader)
            await trio.testing.wait_all_tasks_blocked()
            assert got == []
            collector.put(_output("a", finished=False))
            collector.put_error(EngineDeadError("gone"))
        assert got[0].outputs[0].text == "a"

    trio.run(main)


def test_finished_output_is_not_replaced_by_an_error():
    collector = RequestOutputCollector()
    collector.put(_output("done", finished=True))
    collector.put_error(EngineDeadError("gone"))
    assert collector.get_nowait().finished
    assert collector.get_nowait() is None


def test_stream_interval_batches_delta_outputs():
    collector = RequestOutputCollector(RequestOutputKind.DELTA, stream_interval=4)
    texts = [f"t{i} " for i in range(10)]
    delivered = []
    for i, text in enumerate(texts):
        collector.put(_output(text, finished=i == len(texts) - 1))
        out = collector.get_nowait()
        if out is not None:
            delivered.append(out.outputs[0].text)
    # The first token at once, then every 4 tokens, then the finish with the rest.
    assert delivered == ["t0 ", "t1 t2 t3 t4 ", "t5 t6 t7 t8 ", "t9 "]
    assert "".join(delivered) == "".join(texts)


def test_stream_interval_ignores_cumulative_outputs():
    collector = RequestOutputCollector(RequestOutputKind.CUMULATIVE, stream_interval=4)
    for i in range(3):
        collector.put(_output(f"{i}", finished=False))
        assert collector.get_nowait().outputs[0].text == f"{i}"


def _output(text: str, finished: bool) -> RequestOutput:
    from trillm.outputs import CompletionOutput

    c = CompletionOutput(0, text, [1], None, None, "stop" if finished else None)
    return RequestOutput("x", None, [1], None, [c], finished)


# ---------------------------------------------------------------- aborts, failures, n > 1


def test_abort_request_wakes_reader_with_abort(tok, processor):
    ids = ids_of(tok)
    collector = processor.add_request("a", None, [1], SamplingParams())
    processor.process_outputs([step("a", ids[:3])])
    drain(collector)
    assert processor.abort_request("a") is True
    out = collector.get_nowait()
    assert out.finished and out.outputs[0].finish_reason == "abort"
    assert out.outputs[0].text == tok.decode(ids[:3])
    assert processor.abort_request("a") is False
    assert processor.process_outputs([step("a", ids[3:4])]) == []


def test_engine_abort_finish(tok, processor):
    ids = ids_of(tok, "Hi there")
    # The stop string would complete with the last token, but the engine aborted first.
    params = SamplingParams(stop=["there"])
    seen, aborts = run_one_by_one(processor, ids, params, FinishReason.ABORT)
    assert aborts == [] and seen[-1].outputs[0].finish_reason == "abort"
    assert seen[-1].outputs[0].text == "Hi there"


def test_fail_all_raises_in_readers(tok, processor):
    collector = processor.add_request("f", None, [1], SamplingParams())
    processor.fail_all(EngineDeadError("worker 0 died"))
    with pytest.raises(EngineDeadError, match="worker 0 died"):
        collector.get_nowait()
    assert not processor.has_unfinished_requests()


def test_duplicate_request_id_is_rejected(tok, processor):
    processor.add_request("d", None, [1], SamplingParams())
    with pytest.raises(ValueError, match="already in flight"):
        processor.add_request("d", None, [1], SamplingParams())


@pytest.mark.parametrize("kind", list(RequestOutputKind))
def test_n_children_share_one_collector(tok, processor, kind):
    a, b = ids_of(tok, "Hello world"), ids_of(tok, "Good night moon")
    params = SamplingParams(n=2, output_kind=kind)
    collector = processor.add_request("p", "prompt", [1], params, ["0_p", "1_p"])
    assert processor.child_ids("p") == ["0_p", "1_p"]
    steps = max(len(a), len(b))
    for i in range(steps):
        outs = []
        for req, ids in (("0_p", a), ("1_p", b)):
            if i < len(ids):
                finish = FinishReason.LENGTH if i == len(ids) - 1 else None
                outs.append(step(req, ids[i : i + 1], finish))
        processor.process_outputs(outs)
    merged = drain(collector)  # the reader was stalled the whole time
    assert len(merged) == 1
    out = merged[0]
    assert out.request_id == "p" and out.finished
    assert [c.index for c in out.outputs] == [0, 1]
    assert out.outputs[0].text == tok.decode(a) and out.outputs[1].text == tok.decode(b)
    assert out.outputs[0].token_ids == a and out.outputs[1].token_ids == b
    assert not processor.has_unfinished_requests()


def test_n_children_not_finished_until_all_are(tok, processor):
    collector = processor.add_request("q", None, [1], SamplingParams(n=2), ["0_q", "1_q"])
    processor.process_outputs([step("0_q", [42], FinishReason.LENGTH), step("1_q", [43])])
    outs = drain(collector)
    assert len(outs) == 1 and not outs[0].finished
    assert outs[0].outputs[0].finish_reason == "length" and outs[0].outputs[1].finish_reason is None
    assert processor.abort_request("q") is True
    final = collector.get_nowait()
    assert final.finished and final.outputs[0].index == 1
    assert final.outputs[0].finish_reason == "abort"


# ---------------------------------------------------------------- property: stop strings


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.data(), include=st.booleans())
def test_stop_strings_property(tok, data, include):
    """Random stop strings (substrings of the text, or absent), random step sizes: the streamed
    DELTA text never retracts, and the result matches a reference built from decode()."""
    ids = ids_of(tok)
    full = tok.decode(ids)
    spans = st.tuples(st.integers(0, len(full) - 1), st.integers(1, 6))
    picked = data.draw(st.lists(spans, min_size=1, max_size=3), label="spans")
    stops = [full[a : a + n] for a, n in picked if full[a : a + n].strip()] or ["absent!"]
    stops.append("never seen")
    sizes = data.draw(st.lists(st.integers(1, 4), min_size=len(ids), max_size=len(ids)))
    # Reference: the first token whose decoded prefix contains a stop string, earliest start.
    expect_text, expect_stop, expect_tokens = full, None, ids
    for k in range(len(ids)):
        prefix = tok.decode(ids[: k + 1])
        found = [(prefix.find(s), s) for s in stops if s in prefix]
        if found:
            at, expect_stop = min(found, key=lambda f: f[0])
            expect_text = prefix[: at + len(expect_stop) if include else at]
            expect_tokens = ids[: k + 1]
            break
    processor = OutputProcessor(tok)
    params = SamplingParams(
        stop=stops, include_stop_str_in_output=include, output_kind=RequestOutputKind.DELTA
    )
    collector = processor.add_request("h", None, [1], params)
    streamed, tokens, pos, final = "", [], 0, None
    for size in sizes:
        if pos >= len(ids):
            break
        finish = FinishReason.LENGTH if pos + size >= len(ids) else None
        processor.process_outputs([step("h", ids[pos : pos + size], finish)])
        pos += size
        for out in drain(collector):
            streamed += out.outputs[0].text
            tokens += out.outputs[0].token_ids
            assert expect_text.startswith(streamed)
            final = out if out.finished else final
    assert final is not None
    assert streamed == expect_text and tokens == expect_tokens
    assert final.outputs[0].stop_reason == expect_stop
    assert final.outputs[0].finish_reason == ("stop" if expect_stop else "length")


def test_an_output_that_cannot_be_processed_ends_its_request_alone(tok, processor):
    # A bug on one request's output (here a negative token id its detokenizer refuses) must
    # not escape the handler: that request ends with "abort" and is aborted in the engine.
    bad = processor.add_request("bad", None, [1], SamplingParams())
    good = processor.add_request("good", None, [1], SamplingParams())
    ids = ids_of(tok, "Hi there")
    aborts = processor.process_outputs([step("bad", [-1]), step("good", ids)])
    assert aborts == ["bad"]
    (bad_out,) = drain(bad)
    assert bad_out.finished and bad_out.outputs[0].finish_reason == "abort"
    (good_out,) = drain(good)
    assert good_out.outputs[0].text == tok.decode(ids) and not good_out.finished
