"""``trillm bench``: serving, latency and throughput benchmarks with vLLM's flags and metrics.

- cli.py: argument parsers; ``add_bench_parser(subparsers)`` for the main CLI
- serve.py: open-loop load generator (Gamma arrivals, rate sweeps, Ctrl-C keeps results)
- client.py: one streamed request, timed chunk by chunk
- transport.py: HTTP, a lean h11 keep-alive client on Trio (default) or httpx
- metrics.py: TTFT/TPOT/ITL/E2EL, throughput, goodput, peaks; the summary table
- datasets.py: random, ShareGPT and prefix-repetition prompts
- results_io.py: the result JSON (vLLM's keys) and its file name
- plot.py: PNG of latency CDFs, throughput over time, sweep curves
- latency.py: ``bench latency``, one batch on the offline engine
- throughput.py: ``bench throughput``, offline engine tokens/s
- engine_args.py: ``add_engine_args(parser)``, the engine flags -> ``EngineArgs``
"""
