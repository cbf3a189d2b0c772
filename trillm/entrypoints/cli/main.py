"""The ``trillm`` command: one parser, subcommands registered by the modules that own them.

``serve`` lives in ``trillm.entrypoints.cli.serve_args``, ``run-batch`` in ``run_batch_args``,
``chat`` and ``complete`` in ``client``, ``collect-env`` in ``collect_env``; ``bench`` in
``trillm.bench.cli`` (``add_bench_parser(subparsers)``), added when that module exists. A subcommand's parser sets
``func`` (``parser.set_defaults(func=...)``): a callable taking the parsed args and returning
the exit code.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys
from collections.abc import Sequence

# (module, function) pairs; a module that is not installed is skipped.
SUBCOMMANDS = (
    ("trillm.entrypoints.cli.serve_args", "add_serve_parser"),
    ("trillm.entrypoints.cli.run_batch_args", "add_run_batch_parser"),
    ("trillm.entrypoints.cli.client", "add_client_parsers"),
    ("trillm.entrypoints.cli.collect_env", "add_collect_env_parser"),
    ("trillm.bench.cli", "add_bench_parser"),
)


def build_parser() -> argparse.ArgumentParser:
    import trillm

    parser = argparse.ArgumentParser(prog="trillm", description="trillm: LLM inference on Trio.")
    parser.add_argument("--version", action="version", version=f"trillm {trillm.__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module_name, function in SUBCOMMANDS:
        if importlib.util.find_spec(module_name) is None:
            continue
        getattr(importlib.import_module(module_name), function)(subparsers)
    return parser


def parse_command_line(parser: argparse.ArgumentParser, argv: Sequence[str]) -> argparse.Namespace:
    """The command line as vLLM's parser reads it: flag names with underscores or dashes
    (``--max_model_len``), dotted config flags folded into their JSON flag."""
    from trillm.entrypoints.cli.dotted_flags import dash_flag_names, expand_dotted_flags

    return parser.parse_args(expand_dotted_flags(dash_flag_names(list(argv))))


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parse_command_line(parser, sys.argv[1:] if argv is None else argv)
    func = getattr(args, "func", None)
    if func is None:
        parser.print_help()
        return 2
    code = int(func(args) or 0)
    if args.command == "serve":
        exit_without_finalizing(code)
    return code


def exit_without_finalizing(code: int) -> None:
    """End the process now, its logs and output flushed. A server that has stopped (its
    workers reaped, its rings unlinked) needs nothing from interpreter finalization, whose
    last garbage collection over torch's and transformers' objects takes about a second."""
    import logging
    import os

    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    sys.exit(main())
