"""``trillm run-batch -i IN.jsonl -o OUT.jsonl [MODEL] [serve's flags]`` (vLLM's ``run-batch``).

It takes ``trillm serve``'s model and engine flags, since the batch runs the server's routes
(``trillm/entrypoints/openai/run_batch.py``). The flags that only shape a listening server
(address, TLS, CORS, keys, keep-alive, shutdown, node roles) are refused by name when given:
run-batch opens no socket, and a flag that would do nothing is not taken silently.
"""

from __future__ import annotations

import argparse
import logging
from typing import Any

from trillm.entrypoints.cli import serve_args

# (dest, flag) of serve's flags that only a listening server uses.
HTTP_ONLY = (
    ("host", "--host"),
    ("port", "--port"),
    ("uds", "--uds"),
    ("api_key", "--api-key"),
    ("ssl_keyfile", "--ssl-keyfile"),
    ("ssl_certfile", "--ssl-certfile"),
    ("ssl_ca_certs", "--ssl-ca-certs"),
    ("ssl_cert_reqs", "--ssl-cert-reqs"),
    ("allowed_origins", "--allowed-origins"),
    ("allowed_methods", "--allowed-methods"),
    ("allowed_headers", "--allowed-headers"),
    ("allow_credentials", "--allow-credentials"),
    ("root_path", "--root-path"),
    ("timeout_keep_alive", "--timeout-keep-alive"),
    ("shutdown_timeout", "--shutdown-timeout"),
    ("health_step_timeout", "--health-step-timeout"),
    ("restart_on_engine_death", "--restart-on-engine-death"),
    ("stream_wake_budget", "--stream-wake-budget"),
    ("headless", "--headless"),
    ("disable_uvicorn_access_log", "--disable-uvicorn-access-log"),
    ("enable_server_load_tracking", "--enable-server-load-tracking"),
    ("enable_tokenizer_info_endpoint", "--enable-tokenizer-info-endpoint"),
)


def add_run_batch_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "run-batch",
        help="Answer an OpenAI batch file (JSON lines) offline, as the server would.",
        description="Read requests in OpenAI's batch format (one JSON object per line: "
        "custom_id, method, url, body) and write one answer per line, in the same order, "
        "exactly as `trillm serve` would answer each. Takes serve's model and engine flags.",
    )
    g = p.add_argument_group("batch")
    g.add_argument(
        "-i",
        "--input-file",
        required=True,
        help="The input file: a local path or an http(s) URL (read with GET).",
    )
    g.add_argument(
        "-o",
        "--output-file",
        required=True,
        help="The output file: a local path or an http(s) URL (uploaded with PUT at the end).",
    )
    g.add_argument(
        "--output-tmp-dir",
        help="Where the output is written before it is uploaded to an http(s) --output-file "
        "(default: the system's temporary folder).",
    )
    serve_args.add_serve_flags(p)
    p.set_defaults(func=run_run_batch, serve_parser=p)
    return p


def check_batch_flags(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    for dest, flag in HTTP_ONLY:
        if getattr(args, dest, None) != parser.get_default(dest):
            parser.error(f"argument {flag}: run-batch opens no HTTP server; {flag} does nothing.")
    if args.output_tmp_dir and not args.output_file.startswith(("http://", "https://")):
        parser.error("argument --output-tmp-dir: only used with an http(s) --output-file.")


def run_run_batch(args: argparse.Namespace) -> int:
    import httpx
    import trio

    from trillm.entrypoints.openai.run_batch import run_batch

    check_batch_flags(args.serve_parser, args)
    model = serve_args.prepare(args)
    options = serve_args.server_options(args)
    log = logging.getLogger("trillm.run_batch")
    try:
        trio.run(
            run_batch,
            model,
            serve_args.engine_kwargs(args),
            options,
            args.input_file,
            args.output_file,
            args.output_tmp_dir,
        )
    except (OSError, ValueError, httpx.HTTPError) as exc:  # the files, or a flag refused
        log.error("run-batch: %s", exc)
        return 1
    return 0
