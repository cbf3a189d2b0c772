"""Chooses the native extensions (``trillm._ext.*``, built from ``ext/``) or their pure-Python
twins. ``TRILLM_NO_EXTENSIONS=1`` forces the twins; both have the same API and behaviour."""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from trillm.core.kv_cache_manager import KVCacheManager
    from trillm.core.scheduler import Scheduler


def extensions_disabled() -> bool:
    from trillm import envs

    return envs.NO_EXTENSIONS.get()


def extensions_enabled() -> bool:
    """The project-wide switch: False when ``TRILLM_NO_EXTENSIONS=1``."""
    return not extensions_disabled()


def _load_native(name: str) -> ModuleType | None:
    try:
        return importlib.import_module(f"trillm._ext.{name}")
    except ImportError:
        return None


def native_module(name: str) -> ModuleType | None:
    """The built extension ``trillm._ext.<name>``, or None when not built (ignores the switch)."""
    return _load_native(name)


def cpu_kernels(part: str) -> ModuleType | None:
    """A part of ``trillm._ext.cpu_kernels`` (``"attention"``, ``"gemm"``, ``"ops"``: the native
    CPU kernels, one module so that they share one thread pool), or None when not built
    (ignores the switch, like ``native_module``)."""
    module = _load_native("cpu_kernels")
    return None if module is None else getattr(module, part)


def park_thread_pools() -> None:
    """The native kernels' thread pools stop polling for their next call and sleep until it
    comes: a model step has ended, and until the next one the cores are the engine's and the
    server's (a pool thread polls ~0.5 ms after each call). Nothing when the kernels are not
    built (or were built before ``park_pools``)."""
    park = getattr(cpu_kernels("program"), "park_pools", None)
    if park is not None:
        park()


def native_available(name: str | None = None) -> bool:
    """Whether the native scheduler and KV manager (or just ``name``) are built and enabled."""
    if extensions_disabled():
        return False
    names = (name,) if name else ("scheduler", "kv_cache_manager")
    return all(_load_native(n) is not None for n in names)


def get_scheduler_cls() -> type[Scheduler]:
    """The native scheduler when built and enabled, else the twin; typed as the twin (the
    stubs in ``trillm/_ext/*.pyi`` declare the native classes with the twins' API)."""
    if native_available("scheduler"):
        from trillm._ext.scheduler import Scheduler as NativeScheduler

        return NativeScheduler
    from trillm.core.scheduler import Scheduler as PyScheduler

    return PyScheduler


def get_kv_cache_manager_cls() -> type[KVCacheManager]:
    if native_available("kv_cache_manager"):
        from trillm._ext.kv_cache_manager import KVCacheManager as NativeKVCacheManager

        return NativeKVCacheManager
    from trillm.core.kv_cache_manager import KVCacheManager as PyKVCacheManager

    return PyKVCacheManager
