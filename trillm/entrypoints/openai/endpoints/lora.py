"""LoRA adapters over HTTP (vLLM's flags, routes and model cards).

``--enable-lora --lora-modules name=path ...`` (or the JSON form ``{"name", "path",
"base_model_name"}``) serves each adapter under its name: a request whose ``model`` is an
adapter's name runs with it (``ServerState.check_model``), ``/v1/models`` lists it with
``parent`` = the base model. ``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter``
(bodies ``{"lora_name", "lora_path"}``) exist only with ``--allow-runtime-lora-updating`` or
``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True``; otherwise they are unknown routes (404), as in vLLM.

A runtime load takes a path from a client, so: names are bounded like request ids (a name is
echoed in every chunk's ``model``); the path must be absolute, without ``..``, and (with
``--lora-allowed-root``) inside that folder, symlinks resolved; the adapter's files are read
off the event loop, regular files only, bounded in size (``trillm.lora.files``) and in time,
abandoned on shutdown; and every path that is not a loadable adapter gets the same answer, so
answers do not tell which paths exist. The flags' parsing and checks: ``entrypoints/cli/lora_flags.py``.
"""

from __future__ import annotations

import itertools
import logging
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import trio

from trillm.entrypoints.openai.http.errors import BadRequestError, NotFoundError
from trillm.entrypoints.openai.schemas.protocol import MAX_REQUEST_ID_CHARS
from trillm.lora.files import MAX_CONFIG_BYTES, regular_file_size
from trillm.lora.peft import CONFIG_NAME, WEIGHTS_NAME
from trillm.lora.request import LoRARequest

if TYPE_CHECKING:
    from trillm.engine.async_engine import AsyncEngine
    from trillm.entrypoints.cli.lora_flags import LoRAModulePath

logger = logging.getLogger(__name__)

# A served name is echoed in every response and chunk (``model``), as a request id is.
MAX_LORA_NAME_CHARS = MAX_REQUEST_ID_CHARS
MAX_LORA_PATH_CHARS = 4096  # Linux's PATH_MAX
# A runtime load's file checks, off the event loop; past this the load is refused (a hung
# network mount), its thread abandoned.
ADAPTER_READ_TIMEOUT_S = 30.0
# Threads for those checks: an abandoned thread holds its token until the read returns, so
# loads stuck on a hung mount take these, never the threads the rest of the server uses.
ADAPTER_READ_THREADS = 4
NOT_AN_ADAPTER = (
    "'lora_path' must be an absolute path, without '..', to a folder this server may load "
    f"LoRA adapters from, holding {CONFIG_NAME} and {WEIGHTS_NAME} as regular files."
)


class LoRARegistry:
    """The adapters the server knows by name (one owner: the server state)."""

    def __init__(
        self, base_model_name: str, allow_updates: bool, allowed_root: str | None = None
    ) -> None:
        self.base_model_name = base_model_name
        self.allow_updates = allow_updates
        self.allowed_root = allowed_root  # a real path; None: any absolute path
        self.file_threads = trio.CapacityLimiter(ADAPTER_READ_THREADS)
        self.adapters: dict[str, LoRARequest] = {}
        self._ids = itertools.count(1)  # never reused: a reload is a new adapter to the worker

    async def add(self, engine: AsyncEngine, name: str, path: str, base: str | None = None) -> None:
        """Checks the adapter against the model (engine.check_lora: InvalidRequestError,
        a 400, naming what is wrong) and serves it under ``name``."""
        lora = LoRARequest(name, next(self._ids), path, base)
        await engine.check_lora(lora)
        if name in self.adapters:  # loaded meanwhile, by a request checked beside this one
            raise BadRequestError(
                f"The lora adapter '{name}' has already been loaded.", "lora_name"
            )
        self.adapters[name] = lora

    def remove(self, engine: AsyncEngine, name: str) -> None:
        lora = self.adapters.pop(name)
        checker = engine.lora_checker
        if checker is not None:
            checker.forget(lora.lora_int_id)

    def cards(self) -> list[dict[str, Any]]:
        return [
            {
                "id": name,
                "object": "model",
                "created": 0,
                "owned_by": "trillm",
                "root": lora.lora_path,
                "parent": lora.base_model_name or self.base_model_name,
            }
            for name, lora in self.adapters.items()
        ]


class AdapterPathError(ValueError):
    """A runtime load's path is not a loadable adapter; the reason is logged, never answered."""


async def load_adapter(registry: LoRARegistry, engine: AsyncEngine, body: dict[str, Any]) -> str:
    name, path = body.get("lora_name"), body.get("lora_path")
    if not isinstance(name, str) or not name or not isinstance(path, str) or not path:
        raise BadRequestError("Both 'lora_name' and 'lora_path' must be provided.", "lora_name")
    _check_name_length(name)
    if name in registry.adapters:
        raise BadRequestError(f"The lora adapter '{name}' has already been loaded.", "lora_name")
    if name == registry.base_model_name:
        raise BadRequestError(f"'{name}' is the base model's name.", "lora_name")
    with trio.move_on_after(ADAPTER_READ_TIMEOUT_S):
        try:
            real = await trio.to_thread.run_sync(
                locate_adapter,
                path,
                registry.allowed_root,
                abandon_on_cancel=True,
                limiter=registry.file_threads,
            )
            await registry.add(engine, name, real)
        except AdapterPathError as exc:
            logger.info("LoRA adapter %r refused: %s", name, exc)
            raise BadRequestError(NOT_AN_ADAPTER, "lora_path") from None
        except ValueError as exc:  # the engine's check: what is wrong with the adapter, named
            raise BadRequestError(str(exc), "lora_path") from exc
        return f"Success: LoRA adapter '{name}' added successfully."
    logger.warning(
        "LoRA adapter %r: its files were not read within %s s; refused.",
        name,
        ADAPTER_READ_TIMEOUT_S,
    )
    raise BadRequestError(NOT_AN_ADAPTER, "lora_path")


def locate_adapter(path: str, allowed_root: str | None) -> str:
    """The real path of the adapter folder ``path`` names (blocking: run on a thread), or
    ``AdapterPathError`` with the reason (for the log)."""
    if len(path) > MAX_LORA_PATH_CHARS or "\0" in path:
        raise AdapterPathError("not a usable path (too long, or a NUL).")
    if not os.path.isabs(path) or ".." in Path(path).parts:
        raise AdapterPathError("not an absolute path without '..'.")
    folder = Path(os.path.realpath(path))
    for file in (folder, folder / CONFIG_NAME, folder / WEIGHTS_NAME):
        real = os.path.realpath(file)
        if allowed_root is not None and os.path.commonpath([real, allowed_root]) != allowed_root:
            raise AdapterPathError(f"{real} is outside --lora-allowed-root.")
    try:
        # The weights' size limit depends on the model: the engine's check applies it.
        regular_file_size(folder / CONFIG_NAME, MAX_CONFIG_BYTES)
        regular_file_size(folder / WEIGHTS_NAME, sys.maxsize)
    except OSError as exc:
        raise AdapterPathError(str(exc)) from None
    return str(folder)


def _check_name_length(name: str) -> None:
    if len(name) > MAX_LORA_NAME_CHARS:
        raise BadRequestError(
            f"'lora_name' is {len(name)} characters; the limit is {MAX_LORA_NAME_CHARS}.",
            "lora_name",
        )


def unload_adapter(registry: LoRARegistry, engine: AsyncEngine, body: dict[str, Any]) -> str:
    name = body.get("lora_name")
    if not isinstance(name, str) or not name:
        raise BadRequestError("'lora_name' must be provided.", "lora_name")
    _check_name_length(name)
    if name not in registry.adapters:
        raise NotFoundError(f"The lora adapter '{name}' cannot be found.", "lora_name")
    registry.remove(engine, name)
    return f"Success: LoRA adapter '{name}' removed successfully."


async def open_registry(
    engine: AsyncEngine,
    base_model_name: str,
    modules: list[LoRAModulePath],
    allow_runtime_updating: bool,
    allowed_root: str | None,
) -> LoRARegistry | None:
    """The server's adapters at startup (``--lora-modules``, each checked against the
    model: a bad one stops the server with its reason). None when LoRA is off."""
    if engine.config.lora is None:
        return None
    registry = LoRARegistry(base_model_name, allow_runtime_updating, allowed_root)
    for module in modules:
        if module.name == base_model_name:
            raise ValueError(f"--lora-modules: {module.name!r} is the base model's name.")
        await registry.add(engine, module.name, module.path, module.base_model_name)
    return registry
