"""Where a model's files are: a local folder, the embedded default model, or a Hugging Face
hub id downloaded to the hub cache (``--revision``, ``--download-dir``); and the
``generation_config.json`` that ``--generation-config`` names. ``model_config.py`` reads
config.json from the folder found here."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

_HUB_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "*.txt", "*.model", "*.tiktoken"]


class ModelNotFoundError(FileNotFoundError):
    """Neither a local model folder nor a hub id that could be downloaded."""


def resolve_model_path(model: str | None, revision: str | None = None) -> Path:
    """A local folder as is; ``None`` -> the embedded default model; else a hub id."""
    if model is None:
        from trillm.default_model import ensure_default_model

        return Path(ensure_default_model())
    path = Path(model).expanduser()
    if model.startswith(("/", "./", "../", "~")) and not path.is_dir():
        raise ModelNotFoundError(f"Model folder {model!r} does not exist.")
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelNotFoundError(f"Model folder {str(path)!r} has no config.json.")
        return path
    return _download_from_hub(model, revision)


def _download_from_hub(repo_id: str, revision: str | None) -> Path:
    import huggingface_hub
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    try:
        folder = huggingface_hub.snapshot_download(
            repo_id, revision=revision, allow_patterns=_HUB_PATTERNS
        )
    except (LocalEntryNotFoundError, HfHubHTTPError, OSError, ValueError) as exc:
        raise ModelNotFoundError(
            f"Model {repo_id!r} is not a local folder and could not be downloaded from the "
            f"Hugging Face hub (offline, or no such repository): {type(exc).__name__}: {exc}"
        ) from exc
    return Path(folder)


def read_json(path: Path) -> dict[str, Any]:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def read_generation_config(model_path: Path, mode: str) -> dict[str, Any]:
    """``auto``: the model folder's generation_config.json; ``vllm``: none; else a folder/file."""
    if mode == "vllm":
        return {}
    if mode == "auto":
        path = model_path / "generation_config.json"
        return read_json(path) if path.is_file() else {}
    path = Path(mode).expanduser()
    if path.is_dir():
        path = path / "generation_config.json"
    if not path.is_file():
        raise FileNotFoundError(f"--generation-config {mode!r}: no generation_config.json there.")
    return read_json(path)
