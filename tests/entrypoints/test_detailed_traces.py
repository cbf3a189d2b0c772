"""--collect-detailed-traces as vLLM's: with --otlp-traces-endpoint, each request's
``llm_request`` span carries ``gen_ai.latency.time_in_model_forward`` (``model``) and / or
``gen_ai.latency.time_in_model_execute`` (``worker``), seconds summed over the steps that ran
it; a real ``trillm serve`` (the embedded default model: the real model runner) sends them to
an in-process OTLP receiver. The engine's pieces (the worker's clocks, the pipeline stages'
sum, the core's per-request totals) are checked directly; the refusals as vLLM's."""

from __future__ import annotations

import openai
import pytest
from server_harness import ServerProcess

from trillm.engine.core_traces import CoreTraces
from trillm.messages import (
    CachedRequestData,
    EngineCoreOutput,
    FinishReason,
    ModelRunnerOutput,
    SchedulerOutput,
)
from trillm.worker.step_timing import ExecuteClock, stage_times

FORWARD = "gen_ai.latency.time_in_model_forward"
EXECUTE = "gen_ai.latency.time_in_model_execute"
INFERENCE = "gen_ai.latency.time_in_model_inference"
FAKE = ["--runner", "trillm.worker.fake_runner:FakeModelRunner"]
LONG = 24  # decode steps of the long request


def client(srv: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.base_url, api_key="x", max_retries=0, timeout=120)


def traced_run(tmp_path_factory, flags: list[str], requests) -> tuple[list, list]:
    """``trillm serve FLAGS`` tracing to an in-process receiver; ``requests(client, model)``
    -> its results; the server stops (the last spans leave) -> (spans, results)."""
    from otlp_receivers import HttpReceiver  # opentelemetry: the otel extra

    receiver = HttpReceiver()
    log = tmp_path_factory.mktemp("detailed-traces") / "server.log"
    srv = ServerProcess([*flags, "--otlp-traces-endpoint", receiver.url], log).start()
    try:
        c = client(srv)
        results = requests(c, c.models.list().data[0].id)
    finally:
        code = srv.stop()
        receiver.close()
    assert code == 0, srv.log()
    return receiver.spans, results


def one_and_many(c: openai.OpenAI, model: str) -> list:
    """A 1-token completion, one of LONG tokens (LONG - 1 decode steps more), a chat with
    n=2 (a span per sample)."""
    short = c.completions.create(model=model, prompt="the weather today", max_tokens=1)
    long = c.completions.create(
        model=model,
        prompt="the weather today",
        max_tokens=LONG,
        extra_body={"ignore_eos": True},
    )
    chat = c.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "hello"}],
        max_tokens=3,
        n=2,
        extra_body={"ignore_eos": True},
    )
    return [short, long, chat]


@pytest.fixture(scope="module")
def all_run(tmp_path_factory):
    return traced_run(tmp_path_factory, ["--collect-detailed-traces", "all"], one_and_many)


def span_of(spans, request_id: str):
    (span,) = [s for s in spans if s.attributes["gen_ai.request.id"] == request_id]
    return span.attributes


def test_all_puts_both_times_on_every_span(all_run):
    spans, (short, long, chat) = all_run
    assert len(spans) == 4  # short, long, the chat's two samples
    for span in spans:
        a = span.attributes
        assert 0 < a[FORWARD] <= a[EXECUTE], a
        # both are summed over the steps, which ran between the first schedule and the last
        # token (the inference time, from the engine's clock)
        assert a[EXECUTE] <= a[INFERENCE] + 1e-3, a
    assert span_of(spans, long.id)["gen_ai.usage.completion_tokens"] == LONG


def test_more_steps_more_forward_time(all_run):
    """The long request ran LONG - 1 decode steps after the prefill the short one ran alone:
    its forward total is larger (each step's forward counted for every request it ran)."""
    spans, (short, long, _) = all_run
    one, many = span_of(spans, short.id), span_of(spans, long.id)
    assert many[FORWARD] > one[FORWARD]
    assert many[EXECUTE] > one[EXECUTE]


def test_each_sample_has_its_own_times(all_run):
    spans, (*_, chat) = all_run
    samples = [span_of(spans, f"{i}_{chat.id}") for i in (0, 1)]
    for a in samples:
        assert 0 < a[FORWARD] <= a[EXECUTE] <= a[INFERENCE] + 1e-3


@pytest.mark.parametrize(
    ("value", "present", "absent"), [("model", FORWARD, EXECUTE), ("worker", EXECUTE, FORWARD)]
)
def test_each_value_adds_only_its_attribute(tmp_path_factory, value, present, absent):
    """The fake runner (its forward: the step's bookkeeping) behind a real server."""

    def one(c: openai.OpenAI, model: str) -> list:
        return [c.completions.create(model=model, prompt="hi there", max_tokens=3)]

    spans, _ = traced_run(tmp_path_factory, [*FAKE, "--collect-detailed-traces", value], one)
    (span,) = spans
    assert span.attributes[present] > 0
    assert absent not in span.attributes


# ---------------------------------------------------------------- the engine's pieces


def test_execute_clock_sums_the_calls_of_a_step_and_restarts():
    clock = ExecuteClock(True)
    assert clock.run(sum, [1, 2]) == 3
    clock.run(lambda: sum(range(10_000)))
    out = ModelRunnerOutput(1, [], [])
    clock.stamp(out)
    assert out.model_execute_time is not None and out.model_execute_time > 0
    assert clock.seconds == 0.0
    off, quiet = ExecuteClock(False), ModelRunnerOutput(2, [], [])
    off.run(sum, [1])
    off.stamp(quiet)
    assert quiet.model_execute_time is None and off.seconds == 0.0


def test_pipeline_stages_add_up_tensor_ranks_do_not():
    """tp=2 x pp=2: ranks 0, 1 are stage 0, ranks 2, 3 stage 1 (the output rank, 2)."""
    outs = [ModelRunnerOutput(5, [], [], model_forward_time=f, model_execute_time=2 * f)
            for f in (0.1, 0.7, 0.2, 0.9)]  # fmt: skip
    out = stage_times(outs[2], outs, 2)
    assert out.model_forward_time == pytest.approx(0.3)
    assert out.model_execute_time == pytest.approx(0.6)
    alone = ModelRunnerOutput(5, [], [], model_forward_time=0.4)
    assert stage_times(alone, [alone, outs[1]], 0).model_forward_time == 0.4  # tp only


def sched(step: int, req_ids: list[str], finished: list[str] | None = None) -> SchedulerOutput:
    return SchedulerOutput(
        step_id=step,
        scheduled_new_reqs=[],
        scheduled_cached_reqs=CachedRequestData(),
        num_scheduled_tokens=dict.fromkeys(req_ids, 1),
        total_num_scheduled_tokens=len(req_ids),
        finished_req_ids=finished or [],
    )


def test_core_sums_each_requests_steps_and_drops_it_at_its_end():
    traces = CoreTraces(forward=True, execute=False)
    step1 = ModelRunnerOutput(1, [], [], model_forward_time=0.5, model_execute_time=0.8)
    a, b = EngineCoreOutput("a", [1]), EngineCoreOutput("b", [1])
    traces.step(sched(1, ["a", "b"]), step1, [a, b])
    assert a.model_times == (0.5, None) and b.model_times == (0.5, None)  # execute not asked
    step2 = ModelRunnerOutput(2, [], [], model_forward_time=0.25, model_execute_time=0.3)
    a2 = EngineCoreOutput("a", [2], finish_reason=FinishReason.LENGTH)
    traces.step(sched(2, ["a"]), step2, [a2])
    assert a2.model_times == (0.75, None)
    traces.forget(["b"])  # aborted: no finished output
    assert traces._totals == {}


# ---------------------------------------------------------------- refusals, as vLLM's


def test_llm_refuses_detailed_traces_without_an_endpoint():
    """vLLM's LLM takes it with otlp_traces_endpoint only; trillm's LLM sends no spans."""
    from trillm import LLM

    with pytest.raises(ValueError, match="collect_detailed_traces requires `--otlp-traces"):
        LLM(collect_detailed_traces=["model"])


def test_flag_values_reach_the_server_options(capsys):
    from trillm.entrypoints.cli.main import build_parser
    from trillm.entrypoints.cli.serve_args import server_options
    from trillm.entrypoints.cli.trace_flags import check_trace_flags

    flags = ["serve", *FAKE, "--otlp-traces-endpoint", "localhost:4317"]
    args = build_parser().parse_args([*flags, "--collect-detailed-traces", "worker,model", "all"])
    check_trace_flags(args.serve_parser, args)
    assert server_options(args).collect_detailed_traces == ["worker", "model", "all"]
    with pytest.raises(SystemExit):
        build_parser().parse_args([*flags, "--collect-detailed-traces", "gpu"])
    assert "invalid choice: 'gpu' (choose from model, worker, all)" in capsys.readouterr().err


def test_forward_clock_on_cuda_reads_its_events_in_seconds(monkeypatch):
    """On CUDA the forward is timed by event pairs (milliseconds), read once at the stamp;
    off, nothing is recorded. (A stand-in for torch.cuda.Event: no GPU here.)"""
    import torch

    from trillm.worker.step_timing import ForwardClock

    class Event:
        made: list[Event] = []

        def __init__(self, enable_timing: bool) -> None:
            assert enable_timing
            self.recorded = self.synced = False
            Event.made.append(self)

        def record(self) -> None:
            self.recorded = True

        def synchronize(self) -> None:
            self.synced = True

        def elapsed_time(self, end: Event) -> float:
            assert self.recorded and end.recorded and end.synced
            return 250.0  # ms

    monkeypatch.setattr(torch.cuda, "Event", Event)
    on = type("Config", (), {"collect_model_forward_time": True, "device": "cuda:0"})()
    clock = ForwardClock(on)  # type: ignore[arg-type]
    for _ in range(2):
        with clock:
            pass
    out = clock.stamp(ModelRunnerOutput(1, [], []))
    assert out.model_forward_time == pytest.approx(0.5) and len(Event.made) == 4
    unasked = type("Config", (), {"collect_model_forward_time": False, "device": "cuda:0"})()
    off = ForwardClock(unasked)  # type: ignore[arg-type]
    with off:
        pass
    assert off.stamp(ModelRunnerOutput(2, [], [])).model_forward_time is None
    assert len(Event.made) == 4
