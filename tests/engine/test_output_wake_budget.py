"""The output processor's wake budget: how many stream readers one engine step wakes (the
first output and the finish at once, middle outputs in round-robin slots, stalled streams
released, growth with the model's step time)."""

from __future__ import annotations

from engine_outputs import TEXT, drain, ids_of, step

from trillm.engine.output_processor import OutputProcessor
from trillm.messages import FinishReason
from trillm.outputs import RequestOutput
from trillm.sampling_params import RequestOutputKind, SamplingParams


def _streams(tok, processor, n, kind=RequestOutputKind.DELTA):
    params = SamplingParams(max_tokens=100, output_kind=kind)
    return {f"s{i}": processor.add_request(f"s{i}", TEXT, [1, 5, 7], params) for i in range(n)}


def test_wake_budget_spreads_middle_chunks_first_and_last_at_once(tok):
    """6 streams, budget 2: each stream is woken once every 3 steps for middle tokens (its own
    slot), the first token and the finish at once; the text adds up to decode(ids)."""
    processor = OutputProcessor(tok, wake_budget=2)
    collectors = _streams(tok, processor, 6)
    ids = ids_of(tok)[:10]
    seen: dict[str, list[RequestOutput]] = {r: [] for r in collectors}
    woken_per_step = []
    for i, token in enumerate(ids):
        last = i == len(ids) - 1
        processor.process_outputs(
            [step(r, [token], FinishReason.LENGTH if last else None) for r in collectors]
        )
        woken = 0
        for r, c in collectors.items():
            outs = drain(c)
            woken += bool(outs)
            seen[r] += outs
        woken_per_step.append(woken)
    assert woken_per_step[0] == 6  # every first token at once
    assert woken_per_step[-1] == 6  # every finish at once
    assert all(w == 2 for w in woken_per_step[1:-1]), woken_per_step  # the budget
    for outs in seen.values():
        assert len(outs[0].outputs[0].token_ids) == 1
        assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "length"
        assert all(len(o.outputs[0].token_ids) <= 3 for o in outs)
        assert [t for o in outs for t in o.outputs[0].token_ids] == ids
        assert "".join(o.outputs[0].text for o in outs) == tok.decode(ids)


def test_wake_budget_off_below_the_budget_and_when_disabled(tok):
    for processor, n in (
        (OutputProcessor(tok, wake_budget=8), 8),
        (OutputProcessor(tok, wake_budget=None), 20),
    ):
        collectors = _streams(tok, processor, n)
        for token in ids_of(tok)[:5]:
            processor.process_outputs([step(r, [token]) for r in collectors])
            assert all(len(drain(c)) == 1 for c in collectors.values())


def test_wake_budget_grows_with_model_time(tok):
    """A step whose model time hides the writes of every stream wakes them all."""
    processor = OutputProcessor(tok, wake_budget=2)
    collectors = _streams(tok, processor, 6)
    ids = ids_of(tok)[:20]
    woken = []
    for token in ids:
        processor.process_outputs([step(r, [token]) for r in collectors], model_time_s=0.05)
        woken.append(sum(len(drain(c)) for c in collectors.values()))
    assert woken[-1] == 6, woken


def test_wake_budget_releases_a_stalled_stream(tok):
    """A stream with held tokens that gets no output in a step (preempted) gets them at once."""
    processor = OutputProcessor(tok, wake_budget=1)
    collectors = _streams(tok, processor, 4)
    ids = ids_of(tok)[:3]
    for token in ids:
        processor.process_outputs([step(r, [token]) for r in collectors])
    got = {r: [t for o in drain(c) for t in o.outputs[0].token_ids] for r, c in collectors.items()}
    held = [r for r, toks in got.items() if toks != ids]
    assert held  # some streams hold tokens now
    # A step without their outputs: what they hold is delivered.
    others = [r for r in collectors if r not in held]
    processor.process_outputs([step(r, [9]) for r in others])
    for r in held:
        got[r] += [t for o in drain(collectors[r]) for t in o.outputs[0].token_ids]
        assert got[r] == ids


def test_wake_budget_cumulative_streams_see_everything(tok):
    processor = OutputProcessor(tok, wake_budget=1)
    collectors = _streams(tok, processor, 3, kind=RequestOutputKind.CUMULATIVE)
    ids = ids_of(tok)[:7]
    last: dict[str, RequestOutput] = {}
    for i, token in enumerate(ids):
        finish = FinishReason.LENGTH if i == len(ids) - 1 else None
        processor.process_outputs([step(r, [token], finish) for r in collectors])
        for r, c in collectors.items():
            for o in drain(c):
                last[r] = o
    for o in last.values():
        assert o.finished and o.outputs[0].token_ids == ids
        assert o.outputs[0].text == tok.decode(ids)
