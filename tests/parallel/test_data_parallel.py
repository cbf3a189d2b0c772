"""Data parallelism (issue 14): ``data_parallel_size`` K runs K engine cores (each its own
scheduler, KV cache and workers) behind one frontend.

- the router alone (``trillm/engine/dp_router.py``): least-loaded, prefix affinity and its
  limit, release;
- the Python API: DP=2 gives DP=1's greedy tokens, the requests spread over both cores, an
  abort reaches the core that holds the request (in-process cores: ``uni``);
- one real server with ``--data-parallel-size 2 --tensor-parallel-size 2`` (two cores of two
  ranks each: TP x DP composes): the same tokens over HTTP, ``/metrics`` per ``engine`` label
  shows the spread and the prefix affinity, and a killed worker of core 1 ends every request
  with an error and stops the whole server (/health 503, exit 1) leaving no worker or
  shared-memory segment behind.
"""

from __future__ import annotations

import os
import signal
import time

import httpx
import pytest
import trio
from parallel_reference import (
    LIMITS,
    MAX_TOKENS,
    PROMPTS,
    SHARDED_LLAMA,
    abort_the_second,
    greedy,
    http_greedy_tokens,
    reference_tokens,
)
from prometheus_client.parser import text_string_to_metric_families
from server_harness import ServerProcess, open_request, read_until, stats_engine
from worker_processes import core_worker_ranks, pid_alive

from trillm.engine.dp_router import AFFINITY_SLACK, DataParallelRouter
from trillm.engine.llm import LLM
from trillm.messages import AbortRequests, EngineCoreRequest
from trillm.sampling_params import SamplingParams

SHARED = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi "


@pytest.fixture(scope="module")
def llama(tiny_model_factory) -> str:
    return tiny_model_factory("llama", **SHARDED_LLAMA)  # the TP tests' model: one reference


@pytest.fixture(scope="module")
def dp1_tokens(llama) -> list[list[int]]:
    return reference_tokens(llama)


# ---------------------------------------------------------------- the router


def _req(rid: str, tokens: list[int], salt: str | None = None) -> EngineCoreRequest:
    return EngineCoreRequest(rid, tokens, SamplingParams(), 0.0, cache_salt=salt)


def test_router_picks_the_least_loaded_core_then_the_emptier_kv_cache():
    router = DataParallelRouter(2, block_size=4)
    assert router.route([_req("a", [1])]) == 0
    assert router.route([_req("b", [2])]) == 1
    assert router.route([_req("c0", [3]), _req("c1", [3])]) == 0  # n=2: both samples on one
    assert router.loads == [3, 1] and router.owner("c1") == 0
    assert router.route([_req("d", [4])]) == 1
    assert router.release("c0") == 0 and router.release("c0") is None  # once only
    router.release("c1")
    assert router.loads == [1, 2]
    assert router.route([_req("e", [5])]) == 0
    router.release("e")
    router.release("d")
    router.note_kv_usage(0, 0.5)  # equal queues: the emptier KV cache wins
    assert router.loads == [1, 1] and router.route([_req("f", [6])]) == 1


def test_router_keeps_a_shared_first_block_on_its_core_until_it_is_much_busier():
    router = DataParallelRouter(2, block_size=4)
    prefix = [7, 7, 7, 7]
    assert router.route([_req("p0", prefix + [1])]) == 0
    # Core 0 is busier, yet the same first block follows it (up to the slack) ...
    for i in range(1, AFFINITY_SLACK + 1):
        assert router.route([_req(f"p{i}", prefix + [i, i])]) == 0
    assert router.loads == [AFFINITY_SLACK + 1, 0]
    # ... a different first block (or the same tokens under another cache salt) does not ...
    assert router.route([_req("q", [8, 8, 8, 8, 1])]) == 1
    assert router.route([_req("s", prefix + [1], salt="other")]) == 1
    # ... and past the slack the prefix moves to the least-loaded core, then stays there.
    router.release("q")
    router.release("s")
    assert router.route([_req("p-moved", prefix)]) == 1
    assert router.route([_req("p-after", prefix + [3])]) == 1


def test_router_gives_prompts_shorter_than_a_block_no_affinity():
    router = DataParallelRouter(2, block_size=4)
    assert [router.route([_req(f"r{i}", [9, 9, 9])]) for i in range(4)] == [0, 1, 0, 1]


# ---------------------------------------------------------------- the Python API


def test_python_api_dp2_matches_dp1_and_spreads_the_requests(llama, dp1_tokens):
    """Greedy tokens equal DP=1's; the prompts (shorter than a block: no affinity) went to
    both cores, each core's own scheduler computed them, and a two-sample request finished."""
    sampled = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.8, n=2, ignore_eos=True)
    with LLM(llama, data_parallel_size=2, distributed_executor_backend="uni", **LIMITS) as llm:
        outs = llm.generate(PROMPTS + PROMPTS[:1], [greedy()] * 3 + [sampled], use_tqdm=False)
        engine = llm.engine
        assert engine.data_parallel_size == 2 and len(engine.executors) == 2
        assert engine.router.loads == [0, 0]
        assert min(engine.router.routed) >= 2, engine.router.routed
        queries = [s.prefix_cache_queries for s in engine.get_engine_stats()]
    assert [o.outputs[0].token_ids for o in outs[:3]] == dp1_tokens
    assert [len(c.token_ids) for c in outs[3].outputs] == [MAX_TOKENS] * 2
    assert min(queries) > 0, queries  # both schedulers saw prompts


def test_abort_goes_to_the_core_that_holds_the_request(llama):
    """Two long requests land on cores 0 and 1; aborting the second sends the abort to core 1
    only; its stream ends with 'abort' while the first runs to its length."""
    from trillm.engine.engine_startup import open_engine

    long = SamplingParams(max_tokens=60, temperature=0, ignore_eos=True)
    seen: list[list[str]] = [[], []]

    async def main():
        async with open_engine(
            llama, data_parallel_size=2, distributed_executor_backend="uni", **LIMITS
        ) as engine:
            for index, core in enumerate(engine.cores):
                handle = core.handle_input

                def spy(msg, handle=handle, index=index):
                    if isinstance(msg, AbortRequests):
                        seen[index].extend(msg.request_ids)
                    handle(msg)

                core.handle_input = spy
            rest_b, outs_a = await abort_the_second(engine, long)
            with trio.fail_after(30):
                while engine.cores[1].scheduler.has_unfinished_requests():
                    await trio.sleep(0.01)
            return rest_b[-1], outs_a[-1], engine.router.loads

    last_b, last_a, loads = trio.run(main)
    assert last_b.outputs[0].finish_reason == "abort"
    assert last_a.outputs[0].finish_reason == "length"
    assert seen[1] and not seen[0], seen
    assert loads == [0, 0]


def test_data_parallel_size_below_one_is_refused(llama):
    with pytest.raises(ValueError, match="data_parallel_size must be an integer >= 1"):
        LLM(llama, data_parallel_size=0, **LIMITS)


# ---------------------------------------------------------------- one server, two engine cores


@pytest.fixture(scope="module")
def server(llama, tmp_path_factory):
    log = tmp_path_factory.mktemp("dp-server") / "server.log"
    srv = ServerProcess(
        [
            llama,
            "--data-parallel-size",
            "2",
            "-tp",
            "2",
            "--max-model-len",
            "256",
            "--kv-cache-memory",
            "16MiB",
        ],
        log,
    ).start()
    yield srv
    if srv.proc.poll() is None:
        srv.stop()


def _metrics(server) -> dict:
    text = httpx.get(server.url + "/metrics", timeout=10).text
    return {f.name: f for f in text_string_to_metric_families(text)}


def _per_engine(fams: dict, name: str, sample: str | None = None) -> dict[str, float]:
    return {
        s.labels["engine"]: s.value
        for s in fams[name].samples
        if s.name == (sample or name) and "engine" in s.labels
    }


def _stream_in_flight(server, prompts: list[str], max_tokens: int = 120) -> list:
    """Each prompt streamed; the next one is sent once the previous one's first token is
    out, so every routing decision sees the earlier requests still running."""
    socks = []
    for prompt in prompts:
        body = {"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
        sock = open_request(server, "/v1/completions", body)
        read_until(sock, b"data: {")
        socks.append(sock)
    return socks


def test_http_dp2_tp2_matches_dp1_token_for_token(server, dp1_tokens):
    assert http_greedy_tokens(server.base_url) == dp1_tokens


REQUEST_HISTOGRAMS = (
    "e2e_request_latency_seconds",
    "time_to_first_token_seconds",
    "request_queue_time_seconds",
    "request_prefill_time_seconds",
    "request_inference_time_seconds",
    "request_decode_time_seconds",
    "request_prompt_tokens",
    "request_generation_tokens",
    "request_params_n",
    "request_params_max_tokens",
)


def _successes(fams: dict) -> dict[str, float]:
    """Finished engine requests per engine, over the finish reasons."""
    total: dict[str, float] = {}
    for s in fams["vllm:request_success"].samples:
        if s.name == "vllm:request_success_total":
            total[s.labels["engine"]] = total.get(s.labels["engine"], 0.0) + s.value
    return total


def _grown(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {e: after[e] - before.get(e, 0.0) for e in after}


def test_metrics_label_each_engine_and_show_the_spread(server):
    """Concurrent short prompts alternate between the cores: both engines' step histograms
    and prefix-cache query counters grow; every engine-scoped series has engine 0 and 1. The
    request series count each request under the core that ran it: both cores' successes grow,
    they add up to the four requests, and every request histogram agrees per core."""
    before = _metrics(server)
    steps0 = _per_engine(before, "vllm:iteration_tokens_total", "vllm:iteration_tokens_total_count")
    for sock in _stream_in_flight(server, ["a", "b", "c", "d"]):
        read_until(sock, b"[DONE]")
        sock.close()
    fams = _metrics(server)
    served = _grown(_successes(before), _successes(fams))
    assert set(served) == {"0", "1"} and min(served.values()) >= 1, served
    assert sum(served.values()) == 4, served
    for hist in REQUEST_HISTOGRAMS:
        name = "vllm:" + hist
        counts = _grown(
            _per_engine(before, name, name + "_count"), _per_engine(fams, name, name + "_count")
        )
        assert counts == served, (hist, counts, served)
    for counter in ("vllm:generation_tokens", "trillm:generation_tokens"):
        tokens = _grown(
            _per_engine(before, counter, counter + "_total"),
            _per_engine(fams, counter, counter + "_total"),
        )
        assert tokens == {e: 120 * n for e, n in served.items()}, (counter, tokens)
    steps = _per_engine(fams, "vllm:iteration_tokens_total", "vllm:iteration_tokens_total_count")
    assert steps["0"] > steps0.get("0", 0) and steps["1"] > steps0.get("1", 0), (steps0, steps)
    for name in (
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:prefix_cache_queries",
        "vllm:num_preemptions",
        "trillm:num_requests_running",
    ):
        assert set(
            _per_engine(
                fams, name, name + "_total" if "queries" in name or "preempt" in name else None
            )
        ) == {"0", "1"}, name
    info = _per_engine(fams, "vllm:cache_config_info")
    assert set(info) == {"0", "1"}
    running = _per_engine(fams, "vllm:num_requests_running")
    assert running == {"0": 0.0, "1": 0.0}


def test_prefix_affinity_keeps_a_shared_prefix_on_one_core(server):
    """Four requests sharing their first blocks, each sent while the earlier ones run: all
    go to one core (its prefix cache hits), the other core sees none of them."""
    name = "vllm:prefix_cache_queries"
    before = _per_engine(_metrics(server), name, name + "_total")
    hits0 = _per_engine(_metrics(server), "vllm:prefix_cache_hits", "vllm:prefix_cache_hits_total")
    socks = _stream_in_flight(server, [SHARED + w for w in ("one", "two", "three", "four")])
    for sock in socks:
        read_until(sock, b"[DONE]")
        sock.close()
    fams = _metrics(server)
    after = _per_engine(fams, name, name + "_total")
    hits = _per_engine(fams, "vllm:prefix_cache_hits", "vllm:prefix_cache_hits_total")
    grew = {e for e in after if after[e] > before[e]}
    assert len(grew) == 1, (before, after)
    (home,) = grew
    assert hits[home] > hits0[home]


def test_killed_worker_of_core_1_stops_the_server_cleanly(server):
    """The chosen behaviour (docs/reliability.md): a dead worker takes the whole engine down,
    as with one core. Core 1's worker killed mid-generation: the streams on both cores end
    with an error event naming it, /health answers 503, the process exits 1 and leaves
    neither a worker nor a shared-memory segment behind."""
    workers = core_worker_ranks(server.proc.pid)
    assert sorted(workers) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    with open(f"/proc/{server.proc.pid}/maps") as f:
        segments = {line.split()[-1] for line in f if "/dev/shm/" in line}
    assert segments
    socks = _stream_in_flight(server, ["x", "y"], max_tokens=240)
    time.sleep(0.2)
    os.kill(workers[1, 1], signal.SIGKILL)
    for sock in socks:
        tail = read_until(sock, b"[DONE]")
        assert b"ServiceUnavailableError" in tail and b"rank 1 of engine core 1" in tail, tail[
            -400:
        ]
    try:
        assert httpx.get(server.url + "/health", timeout=5).status_code == 503
    except httpx.ConnectError:
        pass  # already past the grace period and gone
    assert server.proc.wait(timeout=30) == 1, server.log()
    assert not any(pid_alive(pid) for pid in workers.values())
    assert not any(os.path.exists(s) for s in segments)


# ---------------------------------------------------------------- startup, refusals


def test_one_core_failing_to_start_stops_the_others(monkeypatch):
    """Core 1's worker fails in load_model while core 0's starts: the error is raised and
    both cores' workers and rings are gone (the fake runner: no model)."""
    from worker_processes import shm_exists

    from trillm.engine.dp_router import core_configs
    from trillm.errors import EngineStartupError
    from trillm.executor import factory
    from trillm.executor.abstract import FAKE_RUNNER
    from trillm.worker.fake_runner import make_fake_config

    made = []
    real = factory.make_executor

    def make(config, runner, kwargs=None, **kw):
        if config.parallel.data_parallel_rank == 1:
            kwargs = {"fail_on_load": True}
        made.append(real(config, runner, kwargs, **kw))
        return made[-1]

    monkeypatch.setattr(factory, "make_executor", make)
    config = make_fake_config()
    config.parallel.data_parallel_size = 2

    async def main():
        with trio.fail_after(120):
            async with factory.open_executors(core_configs(config), FAKE_RUNNER):
                pytest.fail("started although core 1 failed")

    with pytest.raises(EngineStartupError, match="told to fail in load_model"):
        trio.run(main)
    # Core 1's worker started (and failed); core 0's may have been cancelled before it spawned
    # its worker (a fast failure), which is as good: nothing of either may be left.
    assert len(made) == 2 and any(ex.worker_pids for ex in made)
    assert not any(pid_alive(pid) for ex in made for pid in ex.worker_pids)
    assert not any(shm_exists(name) for ex in made for name in ex.segment_names)


def test_more_engine_cores_than_gpus_are_refused(llama, monkeypatch):
    """On CUDA each rank of each core needs its own GPU: refused before anything loads."""
    import torch

    from trillm.config import EngineArgs
    from trillm.distributed.engine_fit import check_data_parallel

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 3)
    args = EngineArgs(llama, data_parallel_size=2, tensor_parallel_size=2)
    with pytest.raises(
        ValueError,
        match=r"data_parallel_size=2 x tensor_parallel_size=2 x pipeline_parallel_size=1 needs 4 GPUs",
    ):
        check_data_parallel(args, "cuda")
    check_data_parallel(EngineArgs(llama, data_parallel_size=3), "cuda")  # fits
    uni = EngineArgs(llama, data_parallel_size=2, distributed_executor_backend="uni")
    with pytest.raises(ValueError, match="needs distributed_executor_backend='mp'"):
        check_data_parallel(uni, "cuda")


def test_stats_line_says_its_figures_cover_every_core():
    from trillm.entrypoints.openai.metrics.prometheus import ServerMetrics
    from trillm.entrypoints.openai.metrics.stats_logger import StatsLine
    from trillm.messages import SchedulerStats

    per_core = [
        SchedulerStats(num_running_reqs=2, kv_cache_usage=0.5),
        SchedulerStats(num_running_reqs=1, num_waiting_reqs=4),
    ]
    engine = stats_engine(per_core)
    metrics = ServerMetrics(engine, "m")
    _, message = StatsLine(engine, metrics, now=0.0).line(10.0)
    assert message.startswith("Engines 000-001: ")
    assert "Running: 3 reqs, Waiting: 4 reqs, KV cache usage: 25.0%" in message
    page = metrics.render().decode()
    assert 'vllm:num_requests_waiting{engine="1",model_name="m"} 4.0' in page
    assert 'vllm:iteration_tokens_total_count{engine="1",model_name="m"} 0.0' in page
