"""``trillm bench serve|latency|throughput`` argument parsers (vLLM's flag names).

The main CLI calls ``add_bench_parser(subparsers)``; each leaf parser sets ``func`` to a
``(argparse.Namespace) -> int`` entry point, so the caller runs ``sys.exit(args.func(args))``.
"""

from __future__ import annotations

import argparse
import sys

from trillm.bench.engine_args import add_engine_args

DEFAULT_PORT = 8000


def _run_serve(args: argparse.Namespace) -> int:
    from trillm.bench import serve_flags
    from trillm.bench.serve import run_serve

    serve_flags.check(args.serve_parser, args)
    _fix_serve_args(args)
    return run_serve(args)


def _run_latency(args: argparse.Namespace) -> int:
    from trillm.bench.latency import run_latency

    return run_latency(args)


def _run_throughput(args: argparse.Namespace) -> int:
    from trillm.bench.throughput import run_throughput

    return run_throughput(args)


def _add_dataset_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("dataset")
    g.add_argument(
        "--dataset-name",
        choices=[
            "random",
            "random-mm",
            "sharegpt",
            "custom",
            "hf",
            "prefix-repetition",
            "prefix_repetition",
        ],
        default="random",
    )
    g.add_argument(
        "--dataset-path",
        default=None,
        help="ShareGPT JSON file (sharegpt), JSONL file (custom), local dataset files (hf).",
    )
    g.add_argument("--num-prompts", type=int, default=1000)
    g.add_argument("--random-input-len", type=int, default=1024)
    g.add_argument("--random-output-len", type=int, default=128)
    g.add_argument("--random-range-ratio", type=float, default=0.0)
    g.add_argument("--random-prefix-len", type=int, default=0)
    g.add_argument(
        "--sharegpt-output-len", type=int, default=None, help="Override the reply length."
    )
    g.add_argument("--prefix-repetition-prefix-len", type=int, default=256)
    g.add_argument("--prefix-repetition-suffix-len", type=int, default=256)
    g.add_argument("--prefix-repetition-num-prefixes", type=int, default=10)
    g.add_argument("--prefix-repetition-output-len", type=int, default=128)


def add_serve_args(p: argparse.ArgumentParser) -> None:
    from trillm.bench import serve_flags

    p.add_argument(
        "--backend", choices=["vllm", "openai", "openai-chat", "trillm"], default="openai"
    )
    p.add_argument(
        "--base-url", default=None, help="e.g. http://127.0.0.1:8000 (else --host/--port)"
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=DEFAULT_PORT)
    p.add_argument(
        "--endpoint",
        default=None,
        help="default /v1/completions (chat backend: /v1/chat/completions)",
    )
    p.add_argument(
        "--model",
        default=None,
        help="model name (a local folder also gives the tokenizer); default: the server's first",
    )
    p.add_argument(
        "--served-model-name",
        default=None,
        help="the name sent as 'model' in requests, when it differs from --model",
    )
    p.add_argument(
        "--tokenizer", default=None, help="local tokenizer folder (default: --model if a folder)"
    )
    _add_dataset_args(p)
    p.add_argument(
        "--request-rate",
        type=serve_flags.parse_rates,
        default=[float("inf")],
        help="req/s, inf, or a list 1,2,inf (sweep)",
    )
    p.add_argument("--burstiness", type=float, default=1.0, help="Gamma shape; 1 = Poisson")
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--temperature", type=float, default=None, help="default 0 (greedy)")
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument(
        "--goodput",
        nargs="+",
        default=None,
        metavar="METRIC:MS",
        help="SLOs, e.g. ttft:500 tpot:50",
    )
    p.add_argument("--percentile-metrics", default="ttft,tpot,itl")
    p.add_argument("--metric-percentiles", type=serve_flags.parse_percentiles, default=[99.0])
    p.add_argument("--save-result", action="store_true")
    p.add_argument("--result-dir", default=None)
    p.add_argument("--result-filename", default=None)
    p.add_argument("--disable-tqdm", action="store_true")
    p.add_argument(
        "--http-client",
        choices=["h11", "httpx"],
        default="h11",
        help="h11: trillm's lean keep-alive client (default); httpx: httpx.AsyncClient",
    )
    p.add_argument(
        "--plot", default=None, metavar="F.png", help="latency CDFs, throughput over time"
    )
    serve_flags.add_flags(p)  # vLLM's other flags (serve_flags.py)
    p.set_defaults(func=_run_serve, serve_parser=p)


def _fix_serve_args(args: argparse.Namespace) -> None:
    if args.endpoint is None:
        args.endpoint = (
            "/v1/chat/completions" if args.backend == "openai-chat" else "/v1/completions"
        )


def add_latency_args(p: argparse.ArgumentParser) -> None:
    add_engine_args(p)
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--num-iters-warmup", type=int, default=10)
    p.add_argument("--num-iters", type=int, default=30)
    p.add_argument("--output-json", default=None)
    p.add_argument("--disable-tqdm", action="store_true")
    p.set_defaults(func=_run_latency)


def add_throughput_args(p: argparse.ArgumentParser) -> None:
    add_engine_args(p)
    p.add_argument(
        "--dataset-name", choices=["random", "sharegpt", "prefix-repetition"], default="random"
    )
    p.add_argument("--dataset-path", default=None)
    p.add_argument("--input-len", type=int, default=None)
    p.add_argument("--output-len", type=int, default=None)
    p.add_argument("--num-prompts", type=int, default=1000)
    p.add_argument("--random-range-ratio", type=float, default=0.0)
    p.add_argument(
        "--prefix-len", type=int, default=0, help="shared random prefix (random dataset)"
    )
    p.add_argument("--output-json", default=None)
    p.add_argument("--disable-tqdm", action="store_true")
    p.set_defaults(func=_run_throughput)


def add_bench_subcommands(subparsers: argparse._SubParsersAction) -> None:
    serve = subparsers.add_parser(
        "serve", help="online serving benchmark against an OpenAI-compatible server"
    )
    add_serve_args(serve)
    latency = subparsers.add_parser("latency", help="latency of one batch, offline engine")
    add_latency_args(latency)
    throughput = subparsers.add_parser("throughput", help="offline engine throughput")
    add_throughput_args(throughput)


def add_bench_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register ``bench`` on the main CLI's subparsers; leaves set ``args.func``."""
    bench = subparsers.add_parser("bench", help="benchmarks: serve | latency | throughput")
    inner = bench.add_subparsers(dest="bench_command", metavar="{serve,latency,throughput}")
    inner.required = True
    add_bench_subcommands(inner)
    return bench


def run_bench(args: argparse.Namespace) -> int:
    """Run the chosen ``bench`` subcommand (after parsing); returns the exit code."""
    return args.func(args)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m trillm.bench", description="trillm benchmarks")
    sub = parser.add_subparsers(dest="bench_command", metavar="{serve,latency,throughput}")
    sub.required = True
    add_bench_subcommands(sub)
    args = parser.parse_args(argv)
    return run_bench(args)


if __name__ == "__main__":
    sys.exit(main())
