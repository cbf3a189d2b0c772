"""Expert parallelism over data-parallel engine cores (``-dp 2 --enable-expert-parallel``,
vLLM's way of serving MoE models): the experts spread over both cores' ranks (core d's rank r
is expert rank d x tp + r), each core's attention on its own requests, and the cores' forwards
kept in lock-step (trillm/engine/dp_lockstep.py: a core with nothing to run sends a dummy
forward, every MoE layer's exchanges with no tokens, so the all-to-alls of the other's step
complete).

Greedy tokens equal the single-rank engine's and log-probs are within 1e-4 of it (the
measure of test_expert_parallel.py) with both cores serving at once and with one core idle
while the other serves; an abort on one core mid-stream leaves the other's request running to
its length; /metrics counts each core's pairs at every expert rank.
"""

from __future__ import annotations

import pytest
import trio
from expert_faults import expected_tokens, run_with_fault
from expert_parallel_models import LOGPROB_TOL, ODD_EXPERTS, tokens_and_logprobs
from parallel_models import LIMITS, MAX_TOKENS, PROMPTS
from parallel_reference import abort_the_second, greedy

from trillm.engine.llm import LLM
from trillm.testing.tiny_deepseek import build_tiny_deepseek


def assert_close(got, expected) -> None:
    assert [t for t, _ in got] == [t for t, _ in expected]
    diff = max(abs(a - b) for (_, g), (_, e) in zip(got, expected) for a, b in zip(g, e))
    assert diff < LOGPROB_TOL, diff


def assert_dp2_ep_matches_one_rank(path: str, **parallel) -> None:
    """Three prompts at once (both cores serve), then one alone (the other core idle: its
    ranks run dummy forwards for every step of the busy one)."""
    with LLM(path, distributed_executor_backend="uni", **LIMITS) as llm:
        expected = [tokens_and_logprobs(llm, p) for p in (PROMPTS, PROMPTS[2:])]
    layout = {"data_parallel_size": 2, "enable_expert_parallel": True, **parallel}
    with LLM(path, **layout, **LIMITS) as llm:
        engine = llm.engine
        both = tokens_and_logprobs(llm, PROMPTS)
        routed_both = list(engine.router.routed)
        counter = engine.engine_cores.lockstep
        sent_before = list(counter.sent)
        alone = tokens_and_logprobs(llm, PROMPTS[2:])
        sent, dummies = list(counter.sent), list(counter.dummies)
    assert min(routed_both) >= 1, routed_both  # both cores served the first batch
    assert_close(both, expected[0])
    assert_close(alone, expected[1])
    assert sent[0] == sent[1], sent  # every forward of one core met one of the other's
    grown = [a - b for a, b in zip(sent, sent_before)]
    assert grown[0] >= MAX_TOKENS and grown[0] == grown[1], grown
    assert max(dummies) >= MAX_TOKENS - 1, dummies  # the idle core's share of the lone request


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe"])
def test_dp2_ep_matches_one_rank_both_serving_and_one_idle(tiny_model_factory, arch):
    """Each core one rank, holding half of the experts."""
    assert_dp2_ep_matches_one_rank(
        tiny_model_factory(arch, num_hidden_layers=2, **ODD_EXPERTS[arch])
    )


def test_dp2_x_tp2_ep_matches_one_rank(tmp_path):
    """Two cores of two tensor-parallel ranks (4 ranks, each a quarter of DeepSeek-V3's 8
    routed experts, its own router and its shared experts split within its core): each core
    slices its tokens' dispatch over its own two ranks."""
    path = build_tiny_deepseek(
        "v3", tmp_path, num_hidden_layers=2, moe_intermediate_size=31, n_shared_experts=2
    )
    assert_dp2_ep_matches_one_rank(str(path), tensor_parallel_size=2)


def test_abort_on_one_core_mid_stream_leaves_the_other_running(tiny_model_factory):
    """Two long requests on cores 0 and 1; the second aborted after its first token: its
    stream ends with 'abort', the first runs to its length with the single-rank engine's
    tokens (core 1 then idle, running dummy forwards), and the engine serves on."""
    from trillm.engine.engine_startup import open_engine

    path = tiny_model_factory("mixtral", num_hidden_layers=2, **ODD_EXPERTS["mixtral"])
    long = greedy(40)
    with LLM(path, distributed_executor_backend="uni", **LIMITS) as llm:
        expected = llm.generate(["one two"], long, use_tqdm=False)[0].outputs[0].token_ids

    async def main():
        async with open_engine(
            path, data_parallel_size=2, enable_expert_parallel=True, **LIMITS
        ) as engine:
            rest_b, outs_a = await abort_the_second(engine, long)
            async with engine.generate("five six", greedy(4), "C") as c:
                outs_c = [out async for out in c]
            return rest_b[-1], outs_a[-1], outs_c[-1], engine.engine_cores.lockstep.dummies

    last_b, last_a, last_c, dummies = trio.run(main)
    assert last_b.outputs[0].finish_reason == "abort"
    assert last_a.outputs[0].finish_reason == "length"
    assert list(last_a.outputs[0].token_ids) == list(expected)
    assert len(last_c.outputs[0].token_ids) == 4
    assert dummies[1] > 0, dummies


@pytest.mark.parametrize(
    ("more", "match"),
    [
        (
            {"distributed_executor_backend": "uni"},
            r"enable_expert_parallel with data_parallel_size > 1 needs "
            r"distributed_executor_backend='mp'",
        ),
        (
            {"speculative_config": {"method": "ngram", "num_speculative_tokens": 2}},
            r"speculative_config with enable_expert_parallel and data_parallel_size > 1 is not "
            r"implemented yet",
        ),
        (
            {"enable_sleep_mode": True},
            r"enable_sleep_mode with enable_expert_parallel and data_parallel_size > 1 is not "
            r"implemented yet",
        ),
    ],
    ids=["uni", "speculative", "sleep"],
)
def test_what_the_cores_cannot_keep_in_step_is_refused(tiny_model_factory, more, match):
    path = tiny_model_factory("mixtral", num_hidden_layers=2)
    with pytest.raises(ValueError, match=match):
        LLM(path, data_parallel_size=2, enable_expert_parallel=True, **more, **LIMITS)


def test_the_dummy_forward_is_the_engines_own(tiny_model_factory):
    """collective_rpc cannot send a dummy forward (it would leave one core a forward ahead
    of the others' count); other methods still run on every core's ranks."""
    path = tiny_model_factory("mixtral", num_hidden_layers=2, **ODD_EXPERTS["mixtral"])
    with LLM(path, data_parallel_size=2, enable_expert_parallel=True, **LIMITS) as llm:
        with pytest.raises(ValueError, match="'expert_dummy_forward' is run by the engine"):
            llm.collective_rpc("expert_dummy_forward")
        assert len(llm.collective_rpc("kv_cache_bytes")) == 2  # one rank per core
        assert len(tokens_and_logprobs(llm, PROMPTS[:1])[0][0]) == MAX_TOKENS


@pytest.mark.parametrize(
    "failure",
    [{"after_layers": 0}, {"after_layers": 1}, {"after_exchanges": 4}],
    ids=["before-the-forward", "mid-forward", "after-a-layers-last-exchange"],
)
def test_a_step_failing_on_one_core_fails_only_its_requests(tiny_model_factory, failure):
    """A forward that fails in core 1's worker (before any MoE layer, after the first of
    two, or after the first's last exchange but before it weights the outputs) still
    finishes its MoE exchanges without tokens: core 1's request ends with an abort, core 0's,
    running meanwhile, keeps the single-rank engine's tokens, and both cores serve on
    (without it core 0's rank would wait in the exchange until the collective timeout; a
    layer whose exchanges ran but was counted undone would pair its exchanges with the
    next layer's)."""
    path = tiny_model_factory("mixtral", num_hidden_layers=2, **ODD_EXPERTS["mixtral"])
    got = run_with_fault(path, failure)
    assert got["b"].finish_reason == "abort"
    assert got["a"].finish_reason == "length"
    assert list(got["a"].token_ids) == expected_tokens(path)
    assert len(got["c"].token_ids) == 4


def test_preemption_and_a_pause_on_the_cores_keep_them_in_step(tiny_model_factory):
    """Four requests of mixed lengths over two cores whose caches hold two blocks each
    (preempted requests recompute; finished ones leave their core with fewer or none) give
    the single-rank engine's greedy tokens under the same cache; then a pause (mode "keep")
    while a long request runs on each core, and the resume: the cores pause one after the
    other between their steps (the first held one sends dummy forwards for the other
    meanwhile) and the requests finish with their single-rank tokens."""
    path = tiny_model_factory("mixtral", num_hidden_layers=2, **ODD_EXPERTS["mixtral"])
    tiny_kv = {"max_model_len": 32, "num_gpu_blocks_override": 2}
    params = [greedy(n) for n in (20, 5, 20, 12)]
    prompts = (PROMPTS * 2)[:4]
    with LLM(path, distributed_executor_backend="uni", **tiny_kv) as llm:
        outs = llm.generate(prompts, params, use_tqdm=False)
        expected = [list(o.outputs[0].token_ids) for o in outs]
    layout = {"data_parallel_size": 2, "enable_expert_parallel": True}
    with LLM(path, **layout, **tiny_kv) as llm:
        outs = llm.generate(prompts, params, use_tqdm=False)
        got = [list(o.outputs[0].token_ids) for o in outs]
        preemptions = [c.scheduler.get_stats().num_preemptions for c in llm.engine.cores]
        paused = pause_and_resume(llm, [prompts[0], prompts[2]], params[0])
    assert got == expected
    assert sum(preemptions) > 0, preemptions
    assert paused == [expected[0], expected[2]]


def pause_and_resume(llm: LLM, prompts: list[str], params) -> list[list[int]]:
    """``prompts`` streamed at once (one per core), paused (mode "keep") and resumed while
    they run; -> their tokens. Runs on the engine's own Trio thread."""
    engine = llm.engine

    async def run() -> list[list[int]]:
        got: list = [None] * len(prompts)

        async def one(i: int) -> None:
            async with engine.generate(prompts[i], params, f"p{i}") as stream:
                got[i] = list([out async for out in stream][-1].outputs[0].token_ids)

        async with trio.open_nursery() as nursery:
            for i in range(len(prompts)):
                nursery.start_soon(one, i)
            await trio.sleep(0.2)
            await engine.pause_generation(mode="keep")
            await trio.sleep(0.2)
            await engine.resume_generation()
        return got

    return llm._thread.call(run)


def stop_mid_stream(path: str, **runner) -> tuple[list[int | None], float]:
    """An engine closed while both cores stream -> every rank's exit code, the close's time."""
    from trillm.engine.engine_startup import open_engine

    async def main():
        layout = {"data_parallel_size": 2, "enable_expert_parallel": True}
        async with open_engine(path, **layout, **runner, **LIMITS) as engine:
            async with engine.generate("one two", greedy(40), "A") as a:
                await a.__anext__()
                async with engine.generate("three four", greedy(40), "B") as b:
                    await b.__anext__()
                    await trio.sleep(0.05)
        return [p.returncode for ex in engine.executors for p in ex.processes]

    async def timed():
        start = trio.current_time()
        codes = await main()
        return codes, trio.current_time() - start

    return trio.run(timed)


def test_an_engine_stopped_mid_step_ends_every_rank(tiny_model_factory):
    """The engine closed while both cores stream (a core's task may end with its step sent
    and the other's not, or waiting for its step's output while the other has sent its next
    forward): each core's ending task still sends the dummy forwards the other's last step
    needs, and every rank leaves its group on the executor's Shutdown (exit code 0: none is
    left in an exchange, killed after the grace, its peer then exiting 1)."""
    path = tiny_model_factory("mixtral", num_hidden_layers=2, **ODD_EXPERTS["mixtral"])
    for _ in range(3):  # where the cores' tasks are when they end varies
        codes, took = stop_mid_stream(path)
        assert codes == [0, 0], codes
        assert took < 60, took


def test_a_core_stopped_while_it_waits_for_its_output_still_meets_the_others(
    tiny_model_factory,
):
    """Core 0's ranks sample slowly (0.2 s a step), so the close finds core 0's task waiting
    for its step's output while core 1, answered already, has sent its next forward: core 0's
    ending task sends the dummy forward core 1's ranks wait in, its call's answer read past
    the step output it gave up on (without that: 'Worker rank 0 sent ModelRunnerOutput,
    expected a call result', core 0's rank killed and core 1's exiting 1, every close)."""
    path = tiny_model_factory("mixtral", num_hidden_layers=2, **ODD_EXPERTS["mixtral"])
    runner = "trillm.testing.slow_sampling_runner:SlowSamplingRunner"
    kwargs = {"sample_sleep_s": 0.2, "engine_core": 0}
    codes, took = stop_mid_stream(path, runner=runner, runner_kwargs=kwargs)
    assert codes == [0, 0], codes
    assert took < 60, took
