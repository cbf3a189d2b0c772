"""``logits_processors`` / ``--logits-processors`` (vLLM's): custom logits processor classes,
given as classes or names (``pkg.mod:Cls`` or ``pkg.mod.Cls``), plus every class installed
under the ``vllm.logits_processors`` entry-point group, as vLLM loads them.

The frontend imports each class at start (a name that does not import, or a class that is not
a ``LogitsProcessor``, is refused naming the flag) and checks requests with its
``validate_params``; the config carries ``LogitsProcessorSpec``s (plain data) to the model
workers, which import the classes again: by module name, else from the module's file (a
class defined in the script that started the engine).
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the frontend builds its config without torch (tests/engine/test_startup_path)
    from trillm.sample.logits_processor import LogitsProcessor

ENTRY_POINT_GROUP = "vllm.logits_processors"  # vLLM's group, so its plugins load unchanged
_FLAG = "logits_processors (--logits-processors)"


@dataclass(frozen=True)
class LogitsProcessorSpec:
    """A processor class as plain data: ``module:qualname``, and the module's file (None:
    none, e.g. a built-in module) for a worker that cannot import the module by name."""

    name: str
    file: str | None = None


def resolve_logits_processors(given: list[Any] | None) -> list[LogitsProcessorSpec]:
    """The installed plugins' classes, then the given ones -> their specs (ValueError naming
    the flag for one that does not import or is not a LogitsProcessor)."""
    classes = [_plugin(ep) for ep in entry_points(group=ENTRY_POINT_GROUP)]
    classes += [_given(item) for item in given or ()]
    return [_spec_of(cls) for cls in classes]


def load_logits_processors(specs: list[LogitsProcessorSpec]) -> list[type[LogitsProcessor]]:
    """Specs -> classes (in a worker, or the frontend's request checks)."""
    return [_checked(_import_spec(spec), spec.name) for spec in specs]


def request_refusal(classes: list[type[LogitsProcessor]], params: Any) -> str | None:
    """Why a processor's ``validate_params`` refuses the request's params (vLLM checks them
    at admission too), or None."""
    for cls in classes:
        try:
            cls.validate_params(params)
        except ValueError as exc:
            return f"logits processor {cls.__name__} refused the request: {exc}"
    return None


def _plugin(ep: Any) -> type[LogitsProcessor]:
    try:
        cls = ep.load()
    except Exception as exc:
        raise ValueError(
            f"{_FLAG}: the {ENTRY_POINT_GROUP} plugin {ep.name} = {ep.value!r} does not "
            f"import: {type(exc).__name__}: {exc}"
        ) from exc
    return _checked(cls, ep.value)


def _given(item: Any) -> type[LogitsProcessor]:
    if isinstance(item, type):
        return _checked(item, item.__qualname__)
    if not isinstance(item, str) or not item.strip():
        raise ValueError(f"{_FLAG}: expected a class or a class name, got {item!r}.")
    module, _, qualname = item.partition(":") if ":" in item else item.rpartition(".")
    if not module or not qualname:
        raise ValueError(f"{_FLAG}: {item!r} is not a class name like 'pkg.module:ClassName'.")
    try:
        cls = _attribute(importlib.import_module(module), qualname)
    except Exception as exc:
        raise ValueError(f"{_FLAG}: cannot import {item!r}: {type(exc).__name__}: {exc}") from exc
    return _checked(cls, item)


def _checked(cls: Any, name: str) -> type[LogitsProcessor]:
    from trillm.sample.logits_processor import LogitsProcessor

    if not isinstance(cls, type) or not issubclass(cls, LogitsProcessor):
        raise ValueError(
            f"{_FLAG}: {name} is not a subclass of LogitsProcessor "
            "(trillm.sample.logits_processor, vLLM's interface)."
        )
    return cls


def _spec_of(cls: type[LogitsProcessor]) -> LogitsProcessorSpec:
    if "<locals>" in cls.__qualname__:
        raise ValueError(
            f"{_FLAG}: {cls.__qualname__} is defined inside a function; the model workers "
            "import processors by name, so define it at a module's top level."
        )
    module = sys.modules.get(cls.__module__)
    file = getattr(module, "__file__", None)
    return LogitsProcessorSpec(f"{cls.__module__}:{cls.__qualname__}", file)


def _import_spec(spec: LogitsProcessorSpec) -> Any:
    module_name, _, qualname = spec.name.partition(":")
    if module_name != "__main__":
        try:
            return _attribute(importlib.import_module(module_name), qualname)
        except ImportError:
            if spec.file is None:
                raise
    if spec.file is None:
        raise ImportError(f"{spec.name}: its module has no file to import it from")
    return _attribute(_module_from_file(module_name, spec.file), qualname)


def _module_from_file(module_name: str, file: str) -> Any:
    # NOTE: a script is imported under another name, so its `if __name__ == "__main__":`
    # block (which may start an engine) does not run again.
    name = "__trillm_logits_processors_main__" if module_name == "__main__" else module_name
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, file)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import {module_name} from {file}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def _attribute(module: Any, qualname: str) -> Any:
    obj = module
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj
