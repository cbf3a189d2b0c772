"""``trillm serve``'s LoRA flags (vLLM's names): their parsing and checks, apart from the
routes (``entrypoints/openai/endpoints/lora.py``) so that building the parser imports neither
trio nor the request schemas."""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import dataclass

from trillm import envs

RUNTIME_UPDATING_ENV = envs.ALLOW_RUNTIME_LORA_UPDATING.name


@dataclass(frozen=True)
class LoRAModulePath:
    name: str
    path: str
    base_model_name: str | None = None


def parse_lora_module(value: str) -> LoRAModulePath:
    """argparse type of --lora-modules: ``name=path`` or a JSON object."""
    text = value.strip()
    if text.startswith("{"):
        try:
            obj = json.loads(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(f"invalid JSON {value!r}: {exc}") from None
        if not isinstance(obj, dict) or not {"name", "path"} <= set(obj):
            raise argparse.ArgumentTypeError(f"{value!r}: a JSON module needs name and path.")
        unknown = sorted(set(obj) - {"name", "path", "base_model_name"})
        if unknown:
            raise argparse.ArgumentTypeError(f"{value!r}: unknown key(s) {unknown}.")
        return LoRAModulePath(str(obj["name"]), str(obj["path"]), obj.get("base_model_name"))
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"expected name=path or a JSON object, got {value!r}.")
    return LoRAModulePath(name, path)


def add_lora_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("LoRA adapters")
    g.add_argument(
        "--lora-modules",
        nargs="+",
        type=parse_lora_module,
        metavar="NAME=PATH",
        help='Adapters served under their names: name=path or {"name": .., "path": .., '
        '"base_model_name": ..}.',
    )
    g.add_argument(
        "--allow-runtime-lora-updating",
        action="store_true",
        help=f"Enable /v1/load_lora_adapter and /v1/unload_lora_adapter (also: "
        f"{RUNTIME_UPDATING_ENV}=True).",
    )
    g.add_argument(
        "--lora-allowed-root",
        type=_allowed_root,
        metavar="DIR",
        help="/v1/load_lora_adapter loads adapters only from inside this folder (symlinks "
        "resolved). Default: any absolute path, as vLLM.",
    )


def _allowed_root(value: str) -> str:
    """argparse type of --lora-allowed-root: an existing folder, as its real path."""
    real = os.path.realpath(value)
    if not os.path.isdir(real):
        raise argparse.ArgumentTypeError(f"{value!r} is not a folder.")
    return real


def runtime_updating_allowed(flag: bool) -> bool:
    return flag or envs.ALLOW_RUNTIME_LORA_UPDATING.get()


def check_lora_flags(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """LoRA flags that need --enable-lora, and duplicate adapter names: exit 2, named."""
    if not args.enable_lora:
        for flag in ("lora_modules", "max_loras", "max_lora_rank"):
            if getattr(args, flag) is not None:
                parser.error(f"argument --{flag.replace('_', '-')}: needs --enable-lora.")
        if runtime_updating_allowed(args.allow_runtime_lora_updating):
            parser.error(
                "--allow-runtime-lora-updating / VLLM_ALLOW_RUNTIME_LORA_UPDATING "
                "needs --enable-lora."
            )
    if args.lora_allowed_root is not None and not runtime_updating_allowed(
        args.allow_runtime_lora_updating
    ):
        parser.error(
            "argument --lora-allowed-root: needs --allow-runtime-lora-updating "
            "(or VLLM_ALLOW_RUNTIME_LORA_UPDATING)."
        )
    names = [m.name for m in args.lora_modules or []]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        parser.error(f"argument --lora-modules: adapter name(s) {duplicates} given twice.")
