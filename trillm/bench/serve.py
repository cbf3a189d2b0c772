"""``trillm bench serve``: open-loop load against an OpenAI-compatible server.

Requests arrive as a Gamma process (shape = burstiness, mean gap = 1/rate; burstiness 1 is
Poisson, rate inf sends everything at once), each one streamed and timed by ``client.py``.
Ctrl-C stops the run and still reports, and saves, what completed.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import signal
import sys
import time
from typing import Any

import numpy as np
import trio

from trillm.bench import datasets, metrics, results_io
from trillm.bench.client import RequestSpec, send_request
from trillm.bench.dataset_args import build_dataset
from trillm.bench.serve_report import RunState, ServeContext, finish_run
from trillm.bench.transport import Transport, TransportError, get_json, make_transport
from trillm.gc_heap import freeze_startup_heap

CHAT_ENDPOINT = "/v1/chat/completions"
EXIT_INTERRUPTED = 130
TEST_MAX_TOKENS = 2


class BenchSetupError(RuntimeError):
    """The benchmark cannot start: unreachable server, bad flags, unusable dataset."""


def arrival_offsets(n: int, rate: float, burstiness: float, rng: np.random.Generator) -> np.ndarray:
    """Send times (s from the start) of n requests: the first at 0, Gamma gaps after it."""
    if rate <= 0:
        raise ValueError(f"--request-rate must be positive or inf, got {rate}.")
    if burstiness <= 0:
        raise ValueError(f"--burstiness must be positive, got {burstiness}.")
    if math.isinf(rate):
        return np.zeros(n)
    # mean gap = shape * scale = 1/rate; variance = shape * scale^2 = 1/(rate^2 * burstiness)
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n)
    return np.concatenate(([0.0], np.cumsum(gaps[:-1]))) if n else np.zeros(0)


def ramp_offsets(
    n: int, strategy: str, start: float, end: float, burstiness: float, rng: np.random.Generator
) -> np.ndarray:
    """--ramp-up-strategy: send times whose rate goes from ``start`` to ``end`` req/s over the
    run (linear, or exponential: start * (end/start)**progress); the gap before request i is
    drawn at request i's rate, Gamma-distributed as with a fixed rate."""
    if n <= 1:
        return np.zeros(n)
    progress = np.arange(1, n) / (n - 1)
    if strategy == "linear":
        rates = start + (end - start) * progress
    else:
        rates = start * (end / start) ** progress
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (rates * burstiness))
    return np.concatenate(([0.0], np.cumsum(gaps)))


class Interrupt:
    """SIGINT -> cancel the current run (not the process)."""

    def __init__(self) -> None:
        self.hit = False
        self.scope: trio.CancelScope | None = None

    async def watch(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        with trio.open_signal_receiver(signal.SIGINT) as signals:
            task_status.started()
            async for _ in signals:
                if self.hit:
                    raise KeyboardInterrupt  # a second Ctrl-C: give up on reporting
                self.hit = True
                print("\nInterrupted: stopping, reporting the completed requests.", file=sys.stderr)
                if self.scope is not None:
                    self.scope.cancel()


async def _one(
    client: Transport,
    spec: RequestSpec,
    job: tuple[int, datasets.BenchRequest, str],  # index, prompt, model (LoRA) name
    limiter: trio.CapacityLimiter | None,
    state: RunState | None,  # None: a warm-up request, not measured
    ctx: ServeContext,
) -> None:
    index, req, model = job
    # NOTE: as vLLM, --max-concurrency holds a request back before it is sent: its TTFT
    # starts when it gets a slot, while the arrival schedule keeps running.
    async with limiter if limiter is not None else contextlib.nullcontext():
        result = await send_request(
            client,
            spec,
            req.content(),
            req.prompt_len,
            req.expected_output_len,
            ctx.tokenizer,
            index if state is not None else None,
            model,
        )
    if state is not None:
        state.results.append(result)
        ctx.progress.update(1)


async def warm_up(client: Transport, spec: RequestSpec, ctx: ServeContext) -> None:
    """--num-warmups requests (the dataset's first prompts, under --max-concurrency), before
    the clock starts; their results are dropped."""
    if not ctx.num_warmups:
        return
    print(f"Warming up with {ctx.num_warmups} request(s) ...")
    limiter = trio.CapacityLimiter(ctx.max_concurrency) if ctx.max_concurrency else None
    async with trio.open_nursery() as nursery:
        for i in range(ctx.num_warmups):
            job = (i, ctx.requests[i % len(ctx.requests)], spec.model_for(i))
            nursery.start_soon(_one, client, spec, job, limiter, None, ctx)


async def run_rate(
    client: Transport, spec: RequestSpec, ctx: ServeContext, state: RunState
) -> None:
    """Send every request at its arrival time; returns when all have finished."""
    rng = np.random.default_rng(ctx.seed)
    if ctx.ramp is not None:
        offsets = ramp_offsets(len(ctx.requests), *ctx.ramp, ctx.burstiness, rng)
    else:
        offsets = arrival_offsets(len(ctx.requests), state.rate, ctx.burstiness, rng)
    limiter = trio.CapacityLimiter(ctx.max_concurrency) if ctx.max_concurrency else None
    start = trio.current_time()
    state.t0 = time.perf_counter()
    async with trio.open_nursery() as nursery:
        for i, (req, offset) in enumerate(zip(ctx.requests, offsets)):
            # NOTE: no checkpoint when the send time has passed, so a burst (rate inf) is
            # dispatched in one scheduler step, not one step per request behind the streams.
            if start + offset > trio.current_time():
                await trio.sleep_until(start + float(offset))
            job = (i, req, spec.model_for(i, rng))
            nursery.start_soon(_one, client, spec, job, limiter, state, ctx)
    state.end = time.perf_counter()


async def check_server(args: argparse.Namespace, model: str | None) -> str:
    """Reachability and the model name (the first served model when --model is not given);
    --ready-check-timeout-sec: retried until the server answers or the time is up."""
    url = base_url(args) + "/v1/models"
    deadline = time.monotonic() + args.ready_check_timeout_sec
    while True:
        try:
            status, body = await get_json(url, args.headers, not args.insecure)
        except TransportError as e:
            if time.monotonic() < deadline:
                await trio.sleep(1.0)
                continue
            raise BenchSetupError(f"Cannot reach the server at {base_url(args)}: {e}") from None
        if status >= 500 and time.monotonic() < deadline:  # up, not ready yet (503)
            await trio.sleep(1.0)
            continue
        break
    if model is not None:
        return model
    if status != 200 or not isinstance(body, dict):
        raise BenchSetupError(f"GET {url} answered HTTP {status}; pass --model NAME.")
    served = body.get("data") or []
    if not served:
        raise BenchSetupError(f"The server at {base_url(args)} serves no model; pass --model NAME.")
    return served[0]["id"]


async def probe_request(client: Transport, spec: RequestSpec, req: datasets.BenchRequest) -> None:
    """One short request before the clock starts: a bad model name or endpoint fails here."""
    result = await send_request(client, spec, req.content(), req.prompt_len, TEST_MAX_TOKENS)
    if not result.success:
        raise BenchSetupError(
            f"The test request to {spec.api_url} failed: {result.error}\n"
            "Check --base-url, --endpoint/--backend and --model."
        )


def is_chat(args: argparse.Namespace) -> bool:
    return args.backend == "openai-chat" or args.endpoint.rstrip("/").endswith("chat/completions")


def prepare(args: argparse.Namespace) -> ServeContext:
    """Flags -> dataset and settings; raises BenchSetupError/DatasetError/ValueError."""
    if args.num_prompts < 1:
        raise BenchSetupError(f"--num-prompts must be at least 1, got {args.num_prompts}.")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise BenchSetupError(f"--max-concurrency must be at least 1, got {args.max_concurrency}.")
    tokenizer = (
        None
        if args.skip_tokenizer_init
        else datasets.find_tokenizer(
            args.tokenizer,
            args.model,
            mode=args.tokenizer_mode,
            trust_remote_code=args.trust_remote_code,
        )
    )
    chat = is_chat(args)
    text_datasets = ("random", "random-mm", "prefix-repetition")
    if args.dataset_name in text_datasets and chat and tokenizer is None:
        raise BenchSetupError("The chat endpoint needs text prompts: pass --tokenizer PATH.")
    metrics_list = [m.strip() for m in args.percentile_metrics.split(",") if m.strip()]
    unknown = [m for m in metrics_list if m not in metrics.METRICS]
    if unknown:
        raise BenchSetupError(
            f"Unknown --percentile-metrics {unknown}; choose from {list(metrics.METRICS)}."
        )
    return ServeContext(
        requests=build_dataset(args, tokenizer, chat),
        tokenizer=tokenizer,
        seed=args.seed,
        burstiness=args.burstiness,
        max_concurrency=args.max_concurrency,
        slos=metrics.parse_goodput(args.goodput),
        percentiles=args.metric_percentiles,
        percentile_metrics=metrics_list,
        ramp=None
        if args.ramp_up_strategy is None
        else (args.ramp_up_strategy, args.ramp_up_start_rps, args.ramp_up_end_rps),
        num_warmups=args.num_warmups,
    )


def base_url(args: argparse.Namespace) -> str:
    return (args.base_url or f"http://{args.host}:{args.port}").rstrip("/")


def sampling_params(args: argparse.Namespace) -> dict[str, Any]:
    params = {"temperature": 0.0 if args.temperature is None else args.temperature}
    for name in (
        "top_p",
        "top_k",
        "min_p",
        "frequency_penalty",
        "presence_penalty",
        "repetition_penalty",
    ):
        value = getattr(args, name)
        if value is not None:
            params[name] = value
    if args.use_beam_search:
        params["use_beam_search"] = True
    return params


def make_spec(args: argparse.Namespace, model: str) -> RequestSpec:
    return RequestSpec(
        api_url=base_url(args) + args.endpoint,
        model=model,
        chat=is_chat(args),
        ignore_eos=args.ignore_eos,
        sampling=sampling_params(args),
        extra_body=args.extra_body,
        headers=args.headers,
        request_id_prefix=args.request_id_prefix,
        logprobs=args.logprobs,
        lora_modules=args.lora_modules,
        lora_round_robin=args.lora_assignment == "round-robin",
    )


async def _setup(client: Transport, args: argparse.Namespace, ctx: ServeContext) -> RequestSpec:
    model = await check_server(args, args.served_model_name or args.model)
    spec = make_spec(args, model)
    print(f"Starting the test request to {spec.api_url} (model {model}) ...")
    await probe_request(client, spec, ctx.requests[0])
    print("The test request passed; starting the benchmark.")
    await warm_up(client, spec, ctx)
    return spec


async def _run_rates(
    client: Transport,
    args: argparse.Namespace,
    ctx: ServeContext,
    spec: RequestSpec,
    interrupt: Interrupt,
) -> list[tuple[RunState, dict[str, Any]]]:
    from tqdm import tqdm

    runs = []
    sweep = len(args.request_rate) > 1
    for rate in args.request_rate:
        state = RunState(rate)
        ctx.progress = tqdm(
            total=len(ctx.requests),
            disable=args.disable_tqdm,
            desc=f"rate {results_io.rate_value(rate)}",
        )
        with trio.CancelScope() as scope:
            interrupt.scope = scope
            await run_rate(client, spec, ctx, state)
        ctx.progress.close()
        state.interrupted = interrupt.hit
        runs.append((state, finish_run(args, spec, state, ctx, sweep)))
        if interrupt.hit:
            break
    return runs


async def _serve_main(args: argparse.Namespace, ctx: ServeContext) -> int:
    interrupt = Interrupt()
    client = make_transport(args.http_client, verify=not args.insecure)
    try:
        return await _serve_with(client, args, ctx, interrupt)
    finally:
        with trio.CancelScope(shield=True):
            await client.aclose()


async def _serve_with(
    client: Transport, args: argparse.Namespace, ctx: ServeContext, interrupt: Interrupt
) -> int:
    async with trio.open_nursery() as nursery:
        await nursery.start(interrupt.watch)
        with trio.CancelScope() as setup_scope:
            interrupt.scope = setup_scope
            try:
                spec = await _setup(client, args, ctx)
            except BenchSetupError as e:
                print(f"error: {e}", file=sys.stderr)
                nursery.cancel_scope.cancel()
                return 1
        if interrupt.hit:
            nursery.cancel_scope.cancel()
            return EXIT_INTERRUPTED
        # The dataset, tokenizer and imports out of the collector: its oldest-generation passes
        # over them paused this client ~30-75 ms at a time mid-run, inflating the latencies.
        frozen = freeze_startup_heap("bench client")
        print(f"Froze {frozen} startup objects out of the garbage collector before the load.")
        runs = await _run_rates(client, args, ctx, spec, interrupt)
        nursery.cancel_scope.cancel()
    if args.plot:
        from trillm.bench import plot

        plot.plot_runs(runs, args.plot)
        print(f"Saved the plot to {args.plot}")
    if interrupt.hit:
        return EXIT_INTERRUPTED
    return 0 if all(record["completed"] > 0 for _, record in runs) else 1


def run_serve(args: argparse.Namespace) -> int:
    """Entry point of ``trillm bench serve``; returns the exit code."""
    try:
        ctx = prepare(args)
        return trio.run(_serve_main, args, ctx)
    except (BenchSetupError, datasets.DatasetError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # before the SIGINT handler is up, or a second Ctrl-C
        print("\nInterrupted.", file=sys.stderr)
        return EXIT_INTERRUPTED
