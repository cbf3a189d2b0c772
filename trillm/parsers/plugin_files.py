"""Parser plugins: a Python file the user names (``--tool-parser-plugin``,
``structured_outputs_config.reasoning_parser_plugin``) run once as a module, which registers
its parsers (``register_tool_parser`` / ``register_reasoning_parser``)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path


def run_plugin_file(path: str, flag: str) -> None:
    """Run the Python file ``path``; ValueError naming ``flag`` when it cannot be run."""
    file = Path(path)
    if not file.is_file():
        raise ValueError(f"{flag} {path!r} is not a file.")
    module_name = f"trillm_parser_plugin_{file.stem}"
    spec = importlib.util.spec_from_file_location(module_name, file)
    if spec is None or spec.loader is None:
        raise ValueError(f"{flag} {path!r} cannot be loaded as Python.")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        raise ValueError(f"{flag} {path!r} failed to load: {exc!r}") from exc
