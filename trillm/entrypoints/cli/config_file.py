"""vLLM's ``--config FILE.yaml`` for ``trillm serve``: the file's keys are flag names
(``max-model-len`` or ``max_model_len``; ``model`` for MODEL), its values go through the flags'
own types and checks, and flags given on the command line win wherever they stand relative
to ``--config``."""

from __future__ import annotations

import argparse
import json
from typing import Any


class _ConfigFile(argparse.Action):
    """vLLM's ``--config FILE.yaml``: its keys are flag names (``max-model-len`` or
    ``max_model_len``; ``model`` for MODEL); flags given on the command line win, wherever
    they stand relative to ``--config``."""

    def __call__(self, parser: Any, namespace: Any, values: Any, option_string: Any = None) -> None:
        tokens = config_tokens(parser, str(values))
        from_file = parser.parse_args(tokens)  # the flags' own types and checks apply
        for dest, value in vars(from_file).items():
            if value == parser.get_default(dest):
                continue
            if dest == "model_opt":
                # argparse sets the optional positional MODEL after every flag (None when
                # absent): the file's model is kept apart, used when neither MODEL nor --model.
                dest = "config_model"
            # A flag already given before --config keeps its value; later ones overwrite.
            if getattr(namespace, dest, None) == parser.get_default(dest):  # (None for model)
                setattr(namespace, dest, value)


def config_tokens(parser: argparse.ArgumentParser, path: str) -> list[str]:
    """The YAML file as command-line tokens (an argparse error if it cannot be)."""
    import yaml

    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f)
    except (OSError, yaml.YAMLError) as exc:
        parser.error(f"argument --config: cannot read {path!r}: {exc}")
    if data is None:
        return []
    if not isinstance(data, dict):
        parser.error(f"argument --config: {path!r} must hold a mapping of flag names to values.")
    options = parser._option_string_actions
    tokens: list[str] = []
    for key, value in data.items():
        flag = "--" + str(key).replace("_", "-")
        if flag == "--config":
            parser.error(f"argument --config: {path!r} cannot name another --config.")
        action = options.get(flag)
        if action is None:
            parser.error(f"argument --config: {path!r} has an unknown option {key!r}.")
        tokens += _value_tokens(flag, action, value)
    return tokens


def _value_tokens(flag: str, action: argparse.Action, value: Any) -> list[str]:
    if isinstance(action, argparse.BooleanOptionalAction):
        return [flag if value else "--no-" + flag[2:]]
    if action.nargs == 0:  # a switch: true sets it, false leaves it off
        return [flag] if value else []
    if isinstance(value, list) and action.nargs in ("+", "*"):
        return [flag, *(str(v) for v in value)]
    if isinstance(value, (list, dict)):
        return [flag, json.dumps(value)]
    if isinstance(value, bool):
        return [flag, "true" if value else "false"]
    return [flag, str(value)]


def add_config_flag(p: argparse.ArgumentParser) -> None:
    p.set_defaults(config_model=None)
    p.add_argument(
        "--config",
        action=_ConfigFile,
        metavar="FILE.yaml",
        help="Read flags from a YAML file (keys are flag names, e.g. max-model-len: 2048; "
        "model: for MODEL); flags on the command line override the file.",
    )
