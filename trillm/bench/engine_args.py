"""Engine flags of ``trillm bench latency|throughput``: the model, and the engine flags
``trillm serve`` has (``trillm/entrypoints/cli/engine_flags.py``: one per EngineArgs field).

``engine_args_from_namespace(args)`` builds the ``EngineArgs``. Flags the user did not give stay
``None`` in the namespace, so ``EngineArgs``' own defaults remain the only defaults.
"""

from __future__ import annotations

import argparse
from typing import Any

from trillm.config import EngineArgs
from trillm.entrypoints.cli.engine_flags import add_engine_flags, engine_kwargs


def add_engine_args(parser: argparse.ArgumentParser, *, positional_model: bool = True) -> None:
    """Add the model (positional and/or --model) and the engine flags to ``parser``."""
    g = parser.add_argument_group("model")
    if positional_model:
        g.add_argument(
            "model_tag", nargs="?", default=None, metavar="MODEL", help="model folder or hub id"
        )
    g.add_argument("--model", default=None, help="model folder or hub id (same as MODEL)")
    add_engine_flags(parser)


def engine_kwargs_from_namespace(args: argparse.Namespace) -> dict[str, Any]:
    """The engine flags the user gave, as ``LLM``/``open_engine`` keywords (model excluded)."""
    return engine_kwargs(args)


def model_from_namespace(args: argparse.Namespace) -> str | None:
    tag, flag = getattr(args, "model_tag", None), getattr(args, "model", None)
    if tag is not None and flag is not None and tag != flag:
        raise ValueError(f"Two different models given: MODEL={tag!r} and --model={flag!r}.")
    return tag or flag


def engine_args_from_namespace(args: argparse.Namespace) -> EngineArgs:
    """The EngineArgs alone: a ``--runner module:Class`` is ``open_engine``'s, not a field's."""
    kwargs = engine_kwargs_from_namespace(args)
    if ":" in kwargs.get("runner", ""):
        del kwargs["runner"]
    return EngineArgs.from_kwargs(model_from_namespace(args), **kwargs)
