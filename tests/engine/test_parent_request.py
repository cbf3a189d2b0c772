"""Several prompts as one parent request: ``async with engine.generate_many(...) as items``.

The one submit path of every front (the HTTP server's multi-prompt completions, ``LLM``): each
prompt its own output group, at most ``max_in_flight`` in the engine at once, one deadline,
a prompt's failure its own item, and leaving the block aborts every unfinished prompt. Real
engine core, scheduler, worker subprocess and detokenizer around the near-zero-cost fake
model (its tokens are a function of the request id and position: ``fake_token``)."""

from __future__ import annotations

import pytest
import trio

from trillm import RequestOutputKind, SamplingParams, open_engine
from trillm.engine.preprocess import InvalidRequestError
from trillm.executor.abstract import FAKE_RUNNER
from trillm.worker.fake_runner import fake_token

LONG = SamplingParams(max_tokens=1500, ignore_eos=True)


@pytest.fixture(scope="module")
def model_path(tiny_model_factory):
    return tiny_model_factory("llama")


def _engine(model_path: str):
    return open_engine(
        model_path,
        runner=FAKE_RUNNER,
        runner_kwargs={"step_sleep_s": 0.005},
        max_model_len=2048,
        max_num_seqs=64,
    )


async def _assert_idle(engine) -> None:
    with trio.fail_after(2):
        while (
            engine.output_processor.has_unfinished_requests()
            or engine.cores[0].scheduler.has_unfinished_requests()
        ):
            await trio.sleep(0.005)


async def _own_tokens_and_max_in_flight(engine) -> None:
    lengths = [3, 9, 1, 6, 4, 7, 2]
    ids = [f"p-{i}" for i in range(len(lengths))]
    tokens: dict[int, list[int]] = {i: [] for i in range(len(lengths))}
    reasons: dict[int, str] = {}
    most = 0
    params = [
        SamplingParams(max_tokens=k, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
        for k in lengths
    ]
    prompts = [{"prompt_token_ids": [3, i]} for i in range(len(lengths))]
    async with engine.generate_many(prompts, params, ids, max_in_flight=2) as items:
        async for index, out in items:
            assert not isinstance(out, Exception), out
            most = max(most, engine.output_processor.num_unfinished_requests())
            tokens[index].extend(out.outputs[0].token_ids)
            if out.finished:
                reasons[index] = out.outputs[0].finish_reason
    await _assert_idle(engine)
    vocab = engine.model_config.vocab_size
    for i, k in enumerate(lengths):
        assert tokens[i] == [fake_token(ids[i], 2 + j, vocab) for j in range(k)]
        assert reasons[i] == "length"
    assert 1 <= most <= 2  # never more than max_in_flight prompts registered at once


async def _a_failing_prompt_is_its_own_item(engine) -> None:
    short = SamplingParams(max_tokens=4, ignore_eos=True)
    got: list[tuple[int, object]] = []
    async with engine.generate({"prompt_token_ids": [9]}, LONG, "taken") as held:
        await held.__anext__()
        # the second prompt's id is in flight already: that prompt alone fails
        prompts = [{"prompt_token_ids": [3]}] * 3
        ids = ["free-0", "taken", "free-2"]
        async with engine.generate_many(prompts, short, ids, max_in_flight=1) as items:
            async for index, out in items:
                if isinstance(out, Exception) or out.finished:
                    got.append((index, out))
        # "taken" itself was not aborted by the refusal
        more = await held.__anext__()
        assert not more.finished
    await _assert_idle(engine)
    finals = [o.outputs[0].finish_reason for _, o in got if not isinstance(o, Exception)]
    assert [i for i, _ in got] == [0, 1, 2]  # in order: one prompt in flight at a time
    assert isinstance(got[1][1], InvalidRequestError)
    assert "already in flight" in str(got[1][1])
    assert finals == ["length", "length"]


async def _the_deadline_is_the_whole_requests(engine) -> None:
    reasons: dict[int, str] = {}
    prompts = [{"prompt_token_ids": [3, i]} for i in range(4)]
    start = trio.current_time()
    async with engine.generate_many(prompts, LONG, timeout=0.5, max_in_flight=2) as items:
        async for index, out in items:
            assert not isinstance(out, Exception), out
            if out.finished:
                reasons[index] = out.outputs[0].finish_reason
    took = trio.current_time() - start
    await _assert_idle(engine)
    # all four end by the one deadline, the two never started before it included
    assert reasons == {0: "timeout", 1: "timeout", 2: "timeout", 3: "timeout"}
    assert took < 5


async def _leaving_the_block_aborts_every_unfinished_prompt(engine) -> None:
    prompts = [{"prompt_token_ids": [3, i]} for i in range(5)]
    async with engine.generate_many(prompts, LONG) as items:
        seen = set()
        async for index, _ in items:
            seen.add(index)
            if len(seen) == 5:
                break
    await _assert_idle(engine)
    # a cancelled reader: the same
    with trio.move_on_after(0.3):
        async with engine.generate_many(prompts, LONG) as items:
            async for _ in items:
                pass
    await _assert_idle(engine)
    # a refused first prompt fails the entry and leaves nothing behind
    bad = [{"prompt_token_ids": [3]}, {"prompt_token_ids": [10**9]}]
    with pytest.raises(InvalidRequestError):
        async with engine.generate_many(bad, LONG):
            pass
    await _assert_idle(engine)


# One engine per test (each starts a worker process): two scenarios each.
def test_prompts_get_their_own_tokens_in_flight_bounded_and_fail_alone(model_path):
    async def main() -> None:
        async with _engine(model_path) as engine:
            await _own_tokens_and_max_in_flight(engine)
            await _a_failing_prompt_is_its_own_item(engine)

    trio.run(main)


def test_one_deadline_for_all_prompts_and_leaving_aborts_them_all(model_path):
    async def main() -> None:
        async with _engine(model_path) as engine:
            await _the_deadline_is_the_whole_requests(engine)
            await _leaving_the_block_aborts_every_unfinished_prompt(engine)

    trio.run(main)
