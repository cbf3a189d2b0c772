"""The engine flags of ``trillm serve`` and ``trillm bench latency|throughput``: one per
EngineArgs field, spelled by the field's ``flag(...)`` metadata (``trillm/config/engine_args.py``).

Every flag defaults to None, and ``engine_kwargs`` passes only the flags given, so EngineArgs'
own defaults remain the only defaults.
"""

from __future__ import annotations

import argparse
import functools
import types
from dataclasses import Field, fields
from typing import Any, Literal, Union, get_args, get_origin, get_type_hints

from trillm.config import EngineArgs, Flag
from trillm.entrypoints.cli.flag_types import ENGINE_VALUES

SCALARS = (int, float, str, bool)


@functools.cache
def flag_fields() -> tuple[tuple[Field[Any], Flag], ...]:
    """The EngineArgs fields that are flags, in field order, each with its Flag."""
    return tuple((f, f.metadata["flag"]) for f in fields(EngineArgs) if "flag" in f.metadata)


def add_engine_flags(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("engine")
    for f, spec in flag_fields():
        g.add_argument(f"--{f.name.replace('_', '-')}", *spec.aliases, **_argparse_kwargs(f, spec))


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The engine flags given, as EngineArgs keywords (the model apart)."""
    kwargs = {}
    for f, spec in flag_fields():
        value = getattr(args, f.name, None)
        if value is not None:
            # several: a list field takes them all, another the first (served_model_name)
            first = spec.several and get_origin(_flag_type(f.name)) is not list
            kwargs[f.name] = value[0] if first else value
    return kwargs


def _argparse_kwargs(f: Field[Any], spec: Flag) -> dict[str, Any]:
    kind = _flag_type(f.name)
    kwargs: dict[str, Any] = {"dest": f.name, "default": None, "help": spec.help}
    if kind is bool:
        return kwargs | {"action": argparse.BooleanOptionalAction}
    if get_origin(kind) is Literal:
        kwargs["choices"] = get_args(kind)
    if spec.value is not None:
        kwargs["type"] = ENGINE_VALUES[spec.value]
    elif kind in (int, float):
        kwargs["type"] = kind
    elif kind is not str and get_origin(kind) is not Literal:
        raise TypeError(f"EngineArgs.{f.name}: its Flag needs a value parser for {kind}")
    if spec.metavar is not None:
        kwargs["metavar"] = spec.metavar
    if spec.several:
        kwargs["nargs"] = "+"
    return kwargs


@functools.cache
def _field_types() -> dict[str, Any]:
    """EngineArgs' evaluated annotations, once: evaluating them all per field made every parser
    build (each ``trillm`` command, each test that parses flags) take a quarter second."""
    return get_type_hints(EngineArgs)


def _flag_type(name: str) -> Any:
    """The field's annotation without ``| None``."""
    kind = _field_types()[name]
    if get_origin(kind) in (Union, types.UnionType):
        rest = [a for a in get_args(kind) if a is not type(None)]
        kind = rest[0] if len(rest) == 1 else Union[tuple(rest)]  # noqa: UP007
    return kind
