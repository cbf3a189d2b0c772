"""Sleep mode, pause and collective_rpc (vLLM's RL hooks) on the Trio engine, ``LLM`` and
``AsyncLLM``: greedy tokens and log-probs equal before and after each sleep level (and
transformers'); the worker's KV cache really freed (its bytes and the worker's RSS); a request
in flight while the engine sleeps or is paused (mode keep) ends after the wake-up / resume
with the tokens it would have had; one sent meanwhile waits; partial wake-ups; refusals."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import trio
from hf_reference import hf_greedy

from trillm import LLM, AsyncLLM, SamplingParams, open_engine
from trillm.engine.async_engine import AsyncEngine
from trillm.executor.abstract import FAKE_RUNNER

PROMPTS = [[5, 17, 300, 41, 9], [70, 8], [101, 102, 103, 104, 105, 106, 107, 108, 109]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=1)
KV_MEMORY = 48 * 2**20  # large enough for the worker's RSS to show it go


def _args(**extra) -> dict:
    return dict(max_model_len=128, kv_cache_memory=KV_MEMORY, enable_sleep_mode=True) | extra


async def _greedy(engine: AsyncEngine, tag: str) -> list[tuple[list[int], list[float]]]:
    results: dict[int, tuple[list[int], list[float]]] = {}

    async def one(i: int) -> None:
        async with engine.generate({"prompt_token_ids": PROMPTS[i]}, GREEDY, f"{tag}{i}") as outs:
            async for out in outs:
                pass
        sample = out.outputs[0]
        chosen = [lp[t].logprob for t, lp in zip(sample.token_ids, sample.logprobs, strict=True)]
        results[i] = (list(sample.token_ids), chosen)

    async with trio.open_nursery() as nursery:
        for i in range(len(PROMPTS)):
            nursery.start_soon(one, i)
    return [results[i] for i in range(len(PROMPTS))]


def _rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for {pid}")


def _assert_same(before, after) -> None:
    for (tokens_b, lps_b), (tokens_a, lps_a) in zip(before, after, strict=True):
        assert tokens_a == tokens_b
        assert max(abs(a - b) for a, b in zip(lps_a, lps_b, strict=True)) <= 1e-5


@pytest.mark.parametrize("level", [1, 2])
def test_sleep_frees_the_kv_cache_and_outputs_stay_equal(level, tiny_model_factory):
    path = tiny_model_factory("llama")
    expected = [hf_greedy(path, p, GREEDY.max_tokens) for p in PROMPTS]
    figures: dict[str, int] = {}

    async def main():
        async with open_engine(path, **_args()) as engine:
            before = await _greedy(engine, "b")
            (pid,) = engine.executors[0].worker_pids
            (kv_bytes,) = await engine.collective_rpc("kv_cache_bytes")
            rss_awake = _rss_bytes(pid)
            await engine.sleep(level)
            assert await engine.is_sleeping()
            assert await engine.collective_rpc("kv_cache_bytes") == [0]
            figures.update(kv=kv_bytes, freed=rss_awake - _rss_bytes(pid))
            await engine.wake_up()
            assert not await engine.is_sleeping()
            assert await engine.collective_rpc("kv_cache_bytes") == [kv_bytes]
            after = await _greedy(engine, "a")
        _assert_same(before, after)
        assert [tokens for tokens, _ in after] == expected

    trio.run(main)
    print(f"level {level}: KV cache {figures['kv']} B, worker RSS freed {figures['freed']} B")
    assert figures["kv"] >= KV_MEMORY // 2
    assert figures["freed"] >= figures["kv"] // 2  # the cache's pages went back to the system


def test_partial_wake_up_weights_then_kv_cache(tiny_model_factory):
    path = tiny_model_factory("qwen2")

    async def main():
        async with open_engine(path, **_args(distributed_executor_backend="uni")) as engine:
            before = await _greedy(engine, "b")
            await engine.sleep(2)
            runner = engine.executors[0].runner
            assert runner._model is None and runner.kv_caches == []
            await engine.wake_up(["weights"])
            assert await engine.is_sleeping()  # the KV cache still sleeps
            assert runner._model is not None and runner.kv_caches == []
            await engine.wake_up(["kv_cache"])
            assert not await engine.is_sleeping()
            _assert_same(before, await _greedy(engine, "a"))

    trio.run(main)


@pytest.mark.parametrize("hold", ["sleep", "pause"])
def test_requests_in_flight_and_sent_meanwhile_end_after_wake_up(hold, tiny_model_factory):
    """mode keep: the running request is preempted and ends after the wake-up (or resume)
    with the tokens of an undisturbed run; one sent while the engine holds waits for it."""
    path = tiny_model_factory("llama")
    long = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)

    async def run(engine: AsyncEngine, prompt: list[int], req_id: str, started: trio.Event, got):
        async with engine.generate({"prompt_token_ids": prompt}, long, req_id) as outs:
            async for out in outs:
                started.set()
        got[req_id] = (out.outputs[0].finish_reason, list(out.outputs[0].token_ids))

    async def main():
        async with open_engine(path, **_args(distributed_executor_backend="uni")) as engine:
            reference: dict = {}
            await run(engine, PROMPTS[0], "ref0", trio.Event(), reference)
            await run(engine, PROMPTS[1], "ref1", trio.Event(), reference)
            got: dict = {}
            async with trio.open_nursery() as nursery:
                first = trio.Event()
                nursery.start_soon(run, engine, PROMPTS[0], "r0", first, got)
                await first.wait()
                if hold == "sleep":
                    await engine.sleep(1, mode="keep")
                else:
                    await engine.pause_generation(mode="keep")
                assert await engine.is_paused() == (hold == "pause")
                nursery.start_soon(run, engine, PROMPTS[1], "r1", trio.Event(), got)
                await trio.testing.wait_all_tasks_blocked()
                scheduler = engine.cores[0].scheduler
                assert not got and scheduler.num_waiting + scheduler.num_running == 2
                if hold == "sleep":
                    assert scheduler.num_running == 0  # preempted: its KV cache is gone
                    await engine.wake_up()
                else:
                    await engine.resume_generation()
            assert got == {"r0": reference["ref0"], "r1": reference["ref1"]}

    trio.run(main)


def test_sleep_and_pause_abort_the_requests_in_flight(tiny_model_factory):
    path = tiny_model_factory("llama")
    long = SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True)

    async def main():
        async with open_engine(path, **_args(distributed_executor_backend="uni")) as engine:
            for hold, release in (
                (engine.pause_generation, engine.resume_generation),
                (engine.sleep, engine.wake_up),
            ):
                first, reasons = trio.Event(), []

                async def one(first=first, reasons=reasons) -> None:
                    async with engine.generate({"prompt_token_ids": PROMPTS[2]}, long) as outs:
                        async for out in outs:
                            first.set()
                    reasons.append(out.outputs[0].finish_reason)

                async with trio.open_nursery() as nursery:
                    nursery.start_soon(one)
                    await first.wait()
                    await hold()  # mode abort, vLLM's default
                assert reasons == ["abort"]
                await release()
            _ = await _greedy(engine, "after")  # serving again

    trio.run(main)


@pytest.mark.parametrize("hold", ["pause", "sleep"])
def test_mode_wait_finishes_the_requests_in_flight_first(hold, tiny_model_factory):
    """vLLM's mode wait: the running request ends (all its tokens) before the pause or sleep
    returns; one sent meanwhile is held and runs after the resume or wake-up."""
    path = tiny_model_factory("llama")
    long = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)

    async def run(engine: AsyncEngine, prompt: list[int], req_id: str, started: trio.Event, got):
        async with engine.generate({"prompt_token_ids": prompt}, long, req_id) as outs:
            async for out in outs:
                started.set()
        got[req_id] = (out.outputs[0].finish_reason, list(out.outputs[0].token_ids))

    async def main():
        async with open_engine(path, **_args(distributed_executor_backend="uni")) as engine:
            reference: dict = {}
            await run(engine, PROMPTS[0], "ref0", trio.Event(), reference)
            await run(engine, PROMPTS[1], "ref1", trio.Event(), reference)
            got: dict = {}
            held = trio.Event()

            async def hold_engine() -> None:
                if hold == "sleep":
                    await engine.sleep(1, mode="wait")
                else:
                    await engine.pause_generation(mode="wait")
                held.set()

            async with trio.open_nursery() as nursery:
                first = trio.Event()
                nursery.start_soon(run, engine, PROMPTS[0], "r0", first, got)
                await first.wait()
                nursery.start_soon(hold_engine)
                while engine.cores[0].control.draining is None:  # the drain has begun
                    await trio.sleep(0.001)
                nursery.start_soon(run, engine, PROMPTS[1], "r1", trio.Event(), got)
                await held.wait()
                assert got == {"r0": reference["ref0"]}  # finished first, all 24 tokens
                assert await engine.is_paused() == (hold == "pause")
                await trio.testing.wait_all_tasks_blocked()
                assert "r1" not in got  # held until the resume / wake-up
                if hold == "sleep":
                    await engine.wake_up()
                else:
                    await engine.resume_generation()
            assert got == {"r0": reference["ref0"], "r1": reference["ref1"]}

    trio.run(main)


def test_refusals_name_what_is_refused(tiny_model_factory):
    path = tiny_model_factory("llama")

    async def main():
        args = _args(distributed_executor_backend="uni", enable_sleep_mode=False)
        async with open_engine(path, **args) as engine:
            with pytest.raises(ValueError, match="--enable-sleep-mode"):
                await engine.sleep(1)
            with pytest.raises(ValueError, match="--enable-sleep-mode"):
                await engine.wake_up()
            with pytest.raises(ValueError, match="'nap'"):
                await engine.pause_generation(mode="nap")
            with pytest.raises(ValueError, match="has no method 'no_such_method'"):
                await engine.collective_rpc("no_such_method")
            with pytest.raises(ValueError, match="has no method '_forward'"):
                await engine.collective_rpc("_forward")
            with pytest.raises(TypeError, match="method name"):
                await engine.collective_rpc(lambda worker: 1)
            assert await engine.reset_prefix_cache() is True
            assert not await engine.is_sleeping() and not await engine.is_paused()
        async with open_engine(path, **_args(distributed_executor_backend="uni")) as engine:
            with pytest.raises(ValueError, match="sleep level=3"):
                await engine.sleep(3)
            with pytest.raises(ValueError, match="wake_up tag 'optimizer'"):
                await engine.wake_up(["optimizer"])
        fake = dict(runner=FAKE_RUNNER, distributed_executor_backend="uni", max_model_len=128)
        async with open_engine(path, **fake) as engine:  # sleep's builtins need the model runner
            with pytest.raises(ValueError, match="'kv_cache_bytes' needs trillm's model runner"):
                await engine.collective_rpc("kv_cache_bytes")

    trio.run(main)


def test_llm_and_async_llm_hooks(tiny_model_factory):
    path = tiny_model_factory("llama")
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    with LLM(path, **_args(distributed_executor_backend="uni")) as llm:
        before = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        llm.sleep(level=2)
        assert llm.is_sleeping() and llm.collective_rpc("kv_cache_bytes") == [0]
        llm.wake_up()
        assert not llm.is_sleeping() and llm.reset_prefix_cache()
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == before

    async def asyncio_side() -> None:
        async with AsyncLLM(path, **_args(distributed_executor_backend="uni")) as llm:
            await llm.sleep(1)
            assert await llm.is_sleeping()
            await llm.wake_up(tags=["kv_cache"])
            await llm.wake_up(tags=["weights"])
            assert not await llm.is_sleeping()
            await llm.pause_generation(mode="keep")
            assert await llm.is_paused()
            await llm.resume_generation()
            (kv_bytes,) = await llm.collective_rpc("kv_cache_bytes", timeout=30)
            assert kv_bytes > 0

    asyncio.run(asyncio_side())
