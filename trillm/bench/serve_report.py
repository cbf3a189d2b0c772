"""``trillm bench serve``'s report of one run: the summary table, the errors, the result
record (vLLM's JSON: --label, --metadata, --save-detailed, --append-result) and the plots
next to it (--plot-timeline, --plot-dataset-stats)."""

from __future__ import annotations

import argparse
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from trillm.bench import datasets, metrics, results_io
from trillm.bench.client import RequestSpec
from trillm.bench.metrics import RequestResult

MAX_ERRORS_SHOWN = 5


@dataclass
class RunState:
    """One rate's run; lives outside the cancel scope so an interrupt keeps what it holds."""

    rate: float
    results: list[RequestResult] = field(default_factory=list)
    t0: float = 0.0  # perf_counter at the first send
    end: float = 0.0
    interrupted: bool = False


@dataclass
class ServeContext:
    """Everything a run needs besides the HTTP client and the per-rate state."""

    requests: list[datasets.BenchRequest]
    tokenizer: datasets.BenchTokenizer | None
    seed: int
    burstiness: float
    max_concurrency: int | None
    slos: metrics.Slos
    percentiles: list[float]
    percentile_metrics: list[str]
    progress: Any = None  # tqdm bar of the current run
    ramp: tuple[str, int, int] | None = None  # --ramp-up-strategy, start and end req/s
    num_warmups: int = 0


def summarize(state: RunState, ctx: ServeContext) -> dict[str, Any]:
    state.results.sort(key=lambda r: r.start_time)  # send order, not completion order
    end = state.end if state.end else time.perf_counter()
    summary = metrics.calculate_metrics(
        state.results,
        max(end - state.t0, 0.0),
        state.t0,
        slos=ctx.slos,
        percentiles=ctx.percentiles,
    )
    if ctx.max_concurrency:
        summary["max_concurrency"] = ctx.max_concurrency
    return summary


def report_errors(results: list[RequestResult]) -> None:
    errors = Counter(r.error for r in results if not r.success)
    if not errors:
        return
    print(f"{sum(errors.values())} request(s) failed; most common errors:", file=sys.stderr)
    for message, count in errors.most_common(MAX_ERRORS_SHOWN):
        print(f"  [{count}x] {message}", file=sys.stderr)


def make_record(
    args: argparse.Namespace, spec: RequestSpec, state: RunState, summary: dict[str, Any]
) -> dict[str, Any]:
    record: dict[str, Any] = {
        "date": time.strftime("%Y%m%d-%H%M%S"),
        "backend": args.backend,
        "endpoint": args.endpoint,
        "model_id": spec.model,
        "tokenizer_id": args.tokenizer or args.model,
        "dataset_name": args.dataset_name,
        "num_prompts": args.num_prompts,
        "request_rate": results_io.rate_value(state.rate),
        "burstiness": args.burstiness,
        "max_concurrency": args.max_concurrency,
        "interrupted": state.interrupted,
        **summary,
    }
    if args.label is not None:
        record["label"] = args.label
    if args.ramp_up_strategy is not None:
        record.update(
            ramp_up_strategy=args.ramp_up_strategy,
            ramp_up_start_rps=args.ramp_up_start_rps,
            ramp_up_end_rps=args.ramp_up_end_rps,
        )
    record.update(args.metadata_pairs)  # --metadata KEY=VALUE, as vLLM saves it
    if args.save_detailed:  # vLLM keeps the per-request lists only when asked
        record.update(metrics.per_request_lists(state.results))
    return record


def finish_run(
    args: argparse.Namespace, spec: RequestSpec, state: RunState, ctx: ServeContext, sweep: bool
) -> dict[str, Any]:
    """Print the table and errors, save the JSON; returns the record."""
    summary = summarize(state, ctx)
    if sweep:
        print(f"\nRequest rate: {results_io.rate_value(state.rate)} req/s")
    title = "Serving Benchmark Result" + (" (interrupted)" if state.interrupted else "")
    print(
        metrics.format_summary(
            summary,
            percentile_metrics=ctx.percentile_metrics,
            percentiles=ctx.percentiles,
            title=title,
        )
    )
    report_errors(state.results)
    record = make_record(args, spec, state, summary)
    saving = args.save_result or args.append_result or args.result_filename
    if saving or args.plot_timeline or args.plot_dataset_stats:
        ramp = None if ctx.ramp is None else ctx.ramp
        default = results_io.default_filename(
            args.label or args.backend, state.rate, args.max_concurrency, spec.model, ramp
        )
        path = results_io.result_path(
            args.result_dir, args.result_filename, default, state.rate, sweep
        )
        if saving:
            results_io.save_json(path, record, append=args.append_result)
            print(f"Saved the result to {path}")
        _plots(args, state, ctx, path)
    return record


def _plots(args: argparse.Namespace, state: RunState, ctx: ServeContext, path: Any) -> None:
    """--plot-timeline and --plot-dataset-stats, next to the result file."""
    from trillm.bench import timeline

    if args.plot_timeline:
        html = path.with_name(path.stem + "_timeline.html")
        timeline.write_timeline(html, state.results, state.t0, args.itl_thresholds)
        print(f"Saved the timeline to {html}")
    if args.plot_dataset_stats:
        png = path.with_name(path.stem + "_dataset_stats.png")
        timeline.plot_dataset_stats(png, ctx.requests)
        print(f"Saved the dataset statistics to {png}")
