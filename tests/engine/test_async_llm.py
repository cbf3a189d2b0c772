"""``trillm.AsyncLLM`` under ``asyncio.run``: the Trio API's behaviours, from asyncio code.
Greedy output equals the Trio API's on a real tiny model; cancelling an asyncio reader aborts
its request; concurrent readers each get their own tokens; an engine failure is raised in the
asyncio reader; shutdown leaves no engine thread and no worker process."""

from __future__ import annotations

import asyncio
import os
import signal
import threading

import pytest
import trio

from trillm import AsyncLLM, EngineArgs, RequestOutputKind, SamplingParams, open_engine
from trillm.errors import EngineDeadError
from trillm.executor.abstract import FAKE_RUNNER
from trillm.worker.fake_runner import fake_token

LONG = SamplingParams(max_tokens=1500, ignore_eos=True)  # ends after 7 s at the earliest


@pytest.fixture(scope="module")
def fake_llm(tiny_model_factory):
    llm = AsyncLLM(
        tiny_model_factory("llama"),
        runner=FAKE_RUNNER,
        runner_kwargs={"step_sleep_s": 0.005},
        max_model_len=2048,
        max_num_seqs=64,
    )
    yield llm
    llm.shutdown()


async def _idle(llm: AsyncLLM) -> None:
    engine = llm.engine
    for _ in range(400):  # 2 s; the requests alone would run for minutes
        if not (
            engine.output_processor.has_unfinished_requests()
            or engine.cores[0].scheduler.has_unfinished_requests()
        ):
            return
        await asyncio.sleep(0.005)
    raise AssertionError("the engine still holds requests")


def _engine_threads() -> set[threading.Thread]:
    """trillm's live threads. Compare with ``- before``: an earlier test's thread (a grammar
    compile) may still end during this one."""
    return {t for t in threading.enumerate() if t.name.startswith("trillm-")}


def test_greedy_output_equals_the_trio_api(tiny_model_factory):
    path = tiny_model_factory("qwen2")
    args = dict(max_model_len=256, kv_cache_memory="8MiB", distributed_executor_backend="uni")
    prompts = ["In the beginning", "The license grants", "A"]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)

    async def trio_side() -> list[list[int]]:
        async with open_engine(path, **args) as engine:
            results = []
            for i, prompt in enumerate(prompts):
                async with engine.generate(prompt, params, f"t{i}") as outputs:
                    async for out in outputs:
                        pass
                results.append(out.outputs[0].token_ids)
            return results

    async def asyncio_side() -> list[list[int]]:
        async with AsyncLLM.from_engine_args(EngineArgs(model=path, **args)) as llm:

            async def one(i: int, prompt: str) -> list[int]:
                async for out in llm.generate(prompt, params, f"a{i}"):
                    pass
                assert out.finished and out.outputs[0].finish_reason == "length"
                return out.outputs[0].token_ids

            return list(await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts))))

    before = _engine_threads()
    expected = trio.run(trio_side)
    assert asyncio.run(asyncio_side()) == expected
    assert all(len(ids) == 8 for ids in expected)
    assert _engine_threads() - before == set()  # `async with` shut its engine thread down


def test_cancelling_the_asyncio_reader_aborts(fake_llm):
    async def main() -> None:
        got = []

        async def reader() -> None:
            async for out in fake_llm.generate({"prompt_token_ids": [3, 4]}, LONG, "cx"):
                got.append(out)

        task = asyncio.create_task(reader())
        await asyncio.sleep(0.3)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert got  # it ran before the cancellation
        await _idle(fake_llm)
        # asyncio.timeout / wait_for: the same path
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.2):
                async for _ in fake_llm.generate({"prompt_token_ids": [5]}, LONG, "to"):
                    pass
        await _idle(fake_llm)
        # abort by id: the reader gets the final 'abort' output
        outs = []

        async def read_all() -> None:
            async for out in fake_llm.generate({"prompt_token_ids": [6]}, LONG, "ab"):
                outs.append(out)

        task = asyncio.create_task(read_all())
        await asyncio.sleep(0.2)
        await fake_llm.abort("ab")
        await asyncio.wait_for(task, 5)
        assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "abort"
        await _idle(fake_llm)

    asyncio.run(main())


def test_concurrent_asyncio_readers(fake_llm):
    n = 48
    vocab = fake_llm.engine.model_config.vocab_size

    async def one(i: int) -> list[int]:
        params = SamplingParams(
            max_tokens=5 + i % 4, ignore_eos=True, output_kind=RequestOutputKind.DELTA
        )
        tokens: list[int] = []
        async for out in fake_llm.generate({"prompt_token_ids": [3, i]}, params, f"q{i}"):
            tokens.extend(out.outputs[0].token_ids)
        return tokens

    async def main() -> list[list[int]]:
        return list(await asyncio.gather(*(one(i) for i in range(n))))

    results = asyncio.run(main())
    for i, tokens in enumerate(results):
        assert tokens == [fake_token(f"q{i}", 2 + k, vocab) for k in range(5 + i % 4)]


def test_open_engine_under_asyncio_points_to_async_llm():
    async def main() -> None:
        async with open_engine(None):
            pass  # pragma: no cover

    with pytest.raises(RuntimeError, match="AsyncLLM"):
        asyncio.run(main())


def test_engine_failure_reaches_the_reader_and_shutdown_leaves_nothing(tiny_model_factory):
    before = _engine_threads()
    llm = AsyncLLM(
        tiny_model_factory("llama"),
        runner=FAKE_RUNNER,
        runner_kwargs={"step_sleep_s": 0.005},
        max_model_len=2048,
    )
    pids = list(llm.engine.executors[0].worker_pids)
    assert pids and _engine_threads() - before == {llm._thread.thread}

    async def main() -> None:
        async def reader() -> None:
            async for _ in llm.generate({"prompt_token_ids": [3]}, LONG, "dies"):
                pass

        task = asyncio.create_task(reader())
        await asyncio.sleep(0.3)
        os.kill(pids[0], signal.SIGKILL)
        with pytest.raises(EngineDeadError):
            await asyncio.wait_for(task, 10)
        assert llm.errored
        with pytest.raises(EngineDeadError):
            async for _ in llm.generate("after death", LONG):
                pass

    try:
        asyncio.run(main())
    finally:
        llm.shutdown()
    assert _engine_threads() - before == set()
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_shutdown_ends_a_waiting_reader(tiny_model_factory):
    before = _engine_threads()
    llm = AsyncLLM(
        tiny_model_factory("llama"),
        runner=FAKE_RUNNER,
        runner_kwargs={"step_sleep_s": 0.005},
        max_model_len=2048,
    )
    pids = list(llm.engine.executors[0].worker_pids)

    async def main() -> None:
        async def reader() -> None:
            async for _ in llm.generate({"prompt_token_ids": [3]}, LONG, "sd"):
                pass

        task = asyncio.create_task(reader())
        await asyncio.sleep(0.3)
        await asyncio.get_running_loop().run_in_executor(None, llm.shutdown)
        with pytest.raises(EngineDeadError, match="shut down"):
            await asyncio.wait_for(task, 10)

    asyncio.run(main())
    assert _engine_threads() - before == set()
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
