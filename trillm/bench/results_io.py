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


def default_filename(
    label: str,
    rate: float,
    max_concurrency: int | None,
    model: str,
    ramp: tuple[str, int, int] | None = None,
) -> str:
    """vLLM's name: ``{label}-{rate}qps`` (or ``{label}-ramp-up-{strategy}-{start}qps-
    {end}qps``), then ``-concurrency{N}``, the model's last path part and the time."""
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    conc = f"-concurrency{max_concurrency}" if max_concurrency else ""
    model_id = model.rstrip("/").split("/")[-1]
    if ramp is not None:
        strategy, start, end = ramp
        return f"{label}-ramp-up-{strategy}-{start}qps-{end}qps{conc}-{model_id}-{stamp}.json"
    return f"{label}-{rate_value(rate)}qps{conc}-{model_id}-{stamp}.json"


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


def save_json(path: Path, record: dict[str, Any], append: bool = False) -> None:
    """Write the record; ``append`` (--append-result): add it to the file as one more line
    (vLLM's layout: the file's JSON objects separated by newlines)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if not append:
        path.write_text(json.dumps(record, indent=2))
        return
    with path.open("a+") as f:
        if f.tell() != 0:
            f.write("\n")
        f.write(json.dumps(record))


def load_json_lines(path: str | Path) -> list[dict[str, Any]]:
    """The records of an --append-result file."""
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def load_json(path: str | Path) -> dict[str, Any]:
    return json.loads(Path(path).read_text())
