"""The Trio request stream: ``async with engine.generate(...) as outputs``. Leaving the block
in any way aborts the request at once (the garbage collector is off in these tests, so
nothing but the block can do it), and many concurrent streams stay independent. Real engine
core, scheduler, worker subprocess and detokenizer around the near-zero-cost fake model."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest
import trio

from trillm import RequestOutputKind, SamplingParams, open_engine
from trillm.engine.preprocess import InvalidRequestError
from trillm.executor.abstract import FAKE_RUNNER
from trillm.worker.fake_runner import fake_token

LONG = SamplingParams(max_tokens=1500, ignore_eos=True)  # ends after 7 s at the earliest


@pytest.fixture(scope="module")
def model_path(tiny_model_factory):
    return tiny_model_factory("llama")


@pytest.fixture(autouse=True)
def no_gc() -> Iterator[None]:
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def _engine(model_path: str):
    return open_engine(
        model_path,
        runner=FAKE_RUNNER,
        runner_kwargs={"step_sleep_s": 0.005},
        max_model_len=2048,
        max_num_seqs=256,
    )


async def _assert_idle(engine) -> None:
    """The output processor and the scheduler both forget the request within a few steps."""
    with trio.fail_after(2):  # the request alone would run for minutes
        while (
            engine.output_processor.has_unfinished_requests()
            or engine.cores[0].scheduler.has_unfinished_requests()
        ):
            await trio.sleep(0.005)


def test_leaving_the_block_aborts_the_request(model_path):
    async def main() -> list[str]:
        reasons = []
        async with _engine(model_path) as engine:
            # break
            async with engine.generate({"prompt_token_ids": [3, 4]}, LONG, "b") as outputs:
                async for out in outputs:
                    if len(out.outputs[0].token_ids) >= 3:
                        break
            await _assert_idle(engine)
            # an exception raised in the block
            with pytest.raises(KeyError):
                async with engine.generate({"prompt_token_ids": [3, 4]}, LONG, "e") as outputs:
                    await outputs.__anext__()
                    raise KeyError("caller bug")
            await _assert_idle(engine)
            # leaving before reading anything
            async with engine.generate({"prompt_token_ids": [3, 4]}, LONG, "x"):
                pass
            await _assert_idle(engine)
            # the stream ends with its final output; reading on stops
            short = SamplingParams(max_tokens=4, ignore_eos=True)
            async with engine.generate({"prompt_token_ids": [3, 4]}, short, "s") as outputs:
                outs = [o async for o in outputs]
                reasons = [c.finish_reason for c in outs[-1].outputs]
                assert [o async for o in outputs] == []
        return reasons

    assert trio.run(main) == ["length"]


def test_cancelling_the_caller_aborts_the_request(model_path):
    async def main() -> None:
        async with _engine(model_path) as engine:
            got = []
            with trio.move_on_after(0.3) as scope:
                async with engine.generate({"prompt_token_ids": [5, 6]}, LONG, "c") as outputs:
                    async for out in outputs:
                        got.append(out)
            assert scope.cancelled_caught and got  # it ran, then the caller was cancelled
            await _assert_idle(engine)
            # a cancelled reader in another task: the same
            async with trio.open_nursery() as nursery:

                async def reader() -> None:
                    async with engine.generate({"prompt_token_ids": [7]}, LONG, "t") as outs:
                        async for _ in outs:
                            pass

                nursery.start_soon(reader)
                await trio.sleep(0.2)
                nursery.cancel_scope.cancel()
            await _assert_idle(engine)

    trio.run(main)


def test_many_concurrent_streams_some_abandoned(model_path):
    n = 96

    async def main() -> tuple[dict[int, list[int]], int]:
        results: dict[int, list[int]] = {}
        async with _engine(model_path) as engine:
            vocab = engine.model_config.vocab_size

            async def one(i: int) -> None:
                params = SamplingParams(
                    max_tokens=6 if i % 2 else 1500,
                    ignore_eos=True,
                    output_kind=RequestOutputKind.DELTA,
                )
                tokens: list[int] = []
                async with engine.generate({"prompt_token_ids": [3, i]}, params, f"m{i}") as outs:
                    async for out in outs:
                        tokens.extend(out.outputs[0].token_ids)
                        if i % 2 == 0 and len(tokens) >= 4:
                            break  # the even ones are abandoned mid-stream
                results[i] = tokens

            async with trio.open_nursery() as nursery:
                for i in range(n):
                    nursery.start_soon(one, i)
            await _assert_idle(engine)
        return results, vocab

    results, vocab = trio.run(main)
    assert sorted(results) == list(range(n))
    for i, tokens in results.items():
        expected = [fake_token(f"m{i}", 2 + k, vocab) for k in range(len(tokens))]
        assert tokens == expected  # each stream got its own tokens, in order
        assert len(tokens) == 6 if i % 2 else len(tokens) >= 4


def test_misuse_is_refused_and_a_duplicate_id_fails_alone(model_path):
    async def main() -> None:
        async with _engine(model_path) as engine:
            stream = engine.generate({"prompt_token_ids": [3]}, LONG, "dup")
            with pytest.raises(RuntimeError, match="async with"):
                await stream.__anext__()  # read outside the block
            short = SamplingParams(max_tokens=5, ignore_eos=True)
            async with engine.generate({"prompt_token_ids": [3]}, short, "dup") as first:
                out = await first.__anext__()
                # the same id while it is in flight: refused; leaving that block must not
                # abort the first request
                with pytest.raises(InvalidRequestError, match="already in flight"):
                    async with engine.generate({"prompt_token_ids": [4]}, short, "dup") as again:
                        await again.__anext__()
                async for out in first:
                    pass
            assert out.finished and out.outputs[0].finish_reason == "length"
            assert len(out.outputs[0].token_ids) == 5
            with pytest.raises(RuntimeError, match="once"):
                async with stream:
                    async with stream:
                        pass
            await _assert_idle(engine)

    trio.run(main)
