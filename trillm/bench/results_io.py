"""Result files: vLLM's JSON layout and file names."""

from __future__ import annotations

import json
import math
from datetime import datetime
from pathlib import Path
from typing import Any


def rate_value(rate: float) -> float | str:
    """JSON has no inf; vLLM writes the string "inf"."""
    return "inf" if math.isinf(rate) else rate


def default_filename(backend: str, rate: float, max_concurrency: int | None, model: str) -> str:
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    conc = f"-concurrency{max_concurrency}" if max_concurrency else ""
    model_id = model.rstrip("/").split("/")[-1]
    return f"{backend}-{rate_value(rate)}qps{conc}-{model_id}-{stamp}.json"


def result_path(
    result_dir: str | None,
    result_filename: str | None,
    default_name: str,
    rate: float,
    sweep: bool,
) -> Path:
    """--result-dir/--result-filename; a sweep adds '-<rate>qps' before the suffix."""
    name = Path(result_filename or default_name)
    if sweep and result_filename:
        name = name.with_name(f"{name.stem}-{rate_value(rate)}qps{name.suffix or '.json'}")
    return Path(result_dir or ".") / name


def save_json(path: Path, record: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=2))


def load_json(path: str | Path) -> dict[str, Any]:
    return json.loads(Path(path).read_text())
