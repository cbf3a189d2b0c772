"""``trillm bench``: serving, latency and throughput benchmarks with vLLM's flags and metrics.

cli.py          argument parsers; ``add_bench_parser(subparsers)`` for the main CLI
serve.py        open-loop load generator (Gamma arrivals, sweeps, Ctrl-C keeps results)
client.py       one streamed request, timed chunk by chunk (httpx on Trio)
metrics.py      TTFT/TPOT/ITL/E2EL, throughput, goodput, peaks; the summary table
datasets.py     random, ShareGPT and prefix-repetition prompts
latency.py      ``bench latency``: one batch, offline engine
throughput.py   ``bench throughput``: offline engine tokens/s
engine_args.py  ``add_engine_args(parser)``: ``trillm serve``'s engine flags -> EngineArgs
plot.py         PNG: latency CDFs, throughput over time, sweep curves
"""
