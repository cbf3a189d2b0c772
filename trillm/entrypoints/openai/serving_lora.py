"""LoRA adapters over HTTP (vLLM's flags, routes and model cards).

``--enable-lora --lora-modules name=path ...`` (or the JSON form ``{"name", "path",
"base_model_name"}``) serves each adapter under its name: a request whose ``model`` is an
adapter's name runs with it (``ServerState.check_model``), ``/v1/models`` lists it with
``parent`` = the base model. ``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter``
(bodies ``{"lora_name", "lora_path"}``) exist only with ``--allow-runtime-lora-updating`` or
``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True``; otherwise they are unknown routes (404), as in vLLM.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
from dataclasses import dataclass
from typing import Any

from trillm.entrypoints.openai.errors import BadRequestError, NotFoundError
from trillm.lora.request import LoRARequest

RUNTIME_UPDATING_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"


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


def _positive_int(value: str) -> int:
    try:
        number = int(value)
    except ValueError:
        number = 0
    if number < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {value!r}.")
    return number


def add_lora_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("LoRA adapters")
    g.add_argument("--enable-lora", action="store_true", default=None,
                   help="Serve LoRA adapters (PEFT folders).")  # fmt: skip
    g.add_argument(
        "--lora-modules", nargs="+", type=parse_lora_module, metavar="NAME=PATH",
        help='Adapters served under their names: name=path or {"name": .., "path": .., '
        '"base_model_name": ..}.',
    )  # fmt: skip
    g.add_argument("--max-loras", type=_positive_int,
                   help="Adapters in flight (and resident on the worker) at once (default: 1).")  # fmt: skip
    g.add_argument("--max-lora-rank", type=_positive_int,
                   help="Highest adapter rank accepted (default: 16).")  # fmt: skip
    g.add_argument(
        "--allow-runtime-lora-updating", action="store_true",
        help=f"Enable /v1/load_lora_adapter and /v1/unload_lora_adapter (also: "
        f"{RUNTIME_UPDATING_ENV}=True).",
    )  # fmt: skip


def runtime_updating_allowed(flag: bool) -> bool:
    return flag or os.environ.get(RUNTIME_UPDATING_ENV, "").strip().lower() in ("1", "true")


def check_lora_flags(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """LoRA flags that need --enable-lora, and duplicate adapter names: exit 2, named."""
    if not args.enable_lora:
        for flag in ("lora_modules", "max_loras", "max_lora_rank"):
            if getattr(args, flag) is not None:
                parser.error(f"argument --{flag.replace('_', '-')}: needs --enable-lora.")
        if runtime_updating_allowed(args.allow_runtime_lora_updating):
            parser.error("--allow-runtime-lora-updating / VLLM_ALLOW_RUNTIME_LORA_UPDATING "
                         "needs --enable-lora.")  # fmt: skip
    names = [m.name for m in args.lora_modules or []]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        parser.error(f"argument --lora-modules: adapter name(s) {duplicates} given twice.")


class LoRARegistry:
    """The adapters the server knows by name (one owner: the server state)."""

    def __init__(self, base_model_name: str, allow_updates: bool) -> None:
        self.base_model_name = base_model_name
        self.allow_updates = allow_updates
        self.adapters: dict[str, LoRARequest] = {}
        self._ids = itertools.count(1)  # never reused: a reload is a new adapter to the worker

    async def add(self, engine: Any, name: str, path: str, base: str | None = None) -> None:
        """Checks the adapter against the model (engine.check_lora: InvalidRequestError,
        a 400, naming what is wrong) and serves it under ``name``."""
        lora = LoRARequest(name, next(self._ids), path, base)
        await engine.check_lora(lora)
        self.adapters[name] = lora

    def remove(self, engine: Any, name: str) -> None:
        lora = self.adapters.pop(name)
        checker = engine.lora_checker
        if checker is not None:
            checker.forget(lora.lora_int_id)

    def cards(self) -> list[dict[str, Any]]:
        return [
            {"id": name, "object": "model", "created": 0, "owned_by": "trillm",
             "root": lora.lora_path, "parent": lora.base_model_name or self.base_model_name}
            for name, lora in self.adapters.items()
        ]  # fmt: skip


async def load_adapter(registry: LoRARegistry, engine: Any, body: dict[str, Any]) -> str:
    name, path = body.get("lora_name"), body.get("lora_path")
    if not isinstance(name, str) or not name or not isinstance(path, str) or not path:
        raise BadRequestError("Both 'lora_name' and 'lora_path' must be provided.", "lora_name")
    if name in registry.adapters:
        raise BadRequestError(f"The lora adapter '{name}' has already been loaded.", "lora_name")
    if name == registry.base_model_name:
        raise BadRequestError(f"'{name}' is the base model's name.", "lora_name")
    try:
        await registry.add(engine, name, path)
    except ValueError as exc:  # the engine's check: what is wrong with the adapter, named
        raise BadRequestError(str(exc), "lora_path") from exc
    return f"Success: LoRA adapter '{name}' added successfully."


def unload_adapter(registry: LoRARegistry, engine: Any, body: dict[str, Any]) -> str:
    name = body.get("lora_name")
    if not isinstance(name, str) or not name:
        raise BadRequestError("'lora_name' must be provided.", "lora_name")
    if name not in registry.adapters:
        raise NotFoundError(f"The lora adapter '{name}' cannot be found.", "lora_name")
    registry.remove(engine, name)
    return f"Success: LoRA adapter '{name}' removed successfully."


async def open_registry(engine: Any, base_model_name: str, opts: Any) -> LoRARegistry | None:
    """The server's adapters at startup (``--lora-modules``, each checked against the
    model: a bad one stops the server with its reason). None when LoRA is off."""
    if engine.config.lora is None:
        return None
    registry = LoRARegistry(base_model_name, opts.allow_runtime_lora_updating)
    for module in opts.lora_modules:
        if module.name == base_model_name:
            raise ValueError(f"--lora-modules: {module.name!r} is the base model's name.")
        await registry.add(engine, module.name, module.path, module.base_model_name)
    return registry
