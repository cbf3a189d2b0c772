"""``limit_mm_per_prompt`` (vLLM's name and shape, ``{"image": N}``): how many items of each
modality one prompt may carry. Checked when the engine arguments are built; resolved against
the model when the config is (a multimodal model: 1 per modality it takes unless set, vLLM's
default; 0 disables a modality; a text-only model takes none)."""

from __future__ import annotations

import json
from typing import Any

MODALITIES = ("image", "video", "audio")
DEFAULT_ITEMS_PER_PROMPT = 1  # vLLM's default for a modality the model takes


def check_limit_mm_per_prompt(value: dict[str, Any] | str | None) -> dict[str, int] | None:
    """A dict (or its JSON) of modality -> count >= 0; ValueError naming the problem."""
    if value is None:
        return None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"limit_mm_per_prompt is not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise ValueError(
            f'limit_mm_per_prompt must be an object like {{"image": 2}}, got {value!r}.'
        )
    limits: dict[str, int] = {}
    for modality, count in value.items():
        if modality not in MODALITIES:
            raise ValueError(
                f"limit_mm_per_prompt: unknown modality {modality!r}; vLLM's are "
                f"{', '.join(MODALITIES)}."
            )
        if isinstance(count, dict):  # vLLM's per-item size options ({"count": N, ...})
            raise ValueError(
                f"limit_mm_per_prompt: per-item options for {modality!r} are not implemented "
                "yet; give a count."
            )
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise ValueError(
                f"limit_mm_per_prompt[{modality!r}] must be an integer >= 0, got {count!r}."
            )
        limits[modality] = count
    return limits


def resolve_limits(
    value: dict[str, Any] | str | None, model_modalities: tuple[str, ...], architecture: str
) -> dict[str, int]:
    """The per-prompt item limits the engine enforces: modality -> count (absent: none)."""
    given = check_limit_mm_per_prompt(value) or {}
    for modality, count in given.items():
        if count and modality not in model_modalities:
            raise ValueError(
                f"limit_mm_per_prompt[{modality!r}]={count}: {architecture} takes no "
                f"{modality} inputs."
            )
    return {m: given.get(m, DEFAULT_ITEMS_PER_PROMPT) for m in model_modalities}


def check_media_args(
    allowed_local_media_path: Any, allowed_media_domains: Any, mm_processor_kwargs: Any
) -> tuple[str, list[str] | None, dict[str, Any] | None]:
    """vLLM's ``allowed_local_media_path`` (a directory, or "" for none),
    ``allowed_media_domains`` (host names; None: any host) and ``mm_processor_kwargs`` (an
    object, or its JSON); ValueError naming the argument. Whether the model's image processor
    takes each key is checked when the engine starts."""
    from pathlib import Path

    if not isinstance(allowed_local_media_path, str):
        raise ValueError(
            f"allowed_local_media_path must be a directory path, got {allowed_local_media_path!r}."
        )
    if allowed_local_media_path and not Path(allowed_local_media_path).is_dir():
        raise ValueError(
            f"allowed_local_media_path {allowed_local_media_path!r} is not a directory."
        )
    domains = allowed_media_domains
    if domains is not None:
        if isinstance(domains, str) or not all(isinstance(d, str) and d for d in domains):
            raise ValueError(
                f"allowed_media_domains must be a list of host names, got {domains!r}."
            )
        domains = list(domains)
    kwargs = mm_processor_kwargs
    if isinstance(kwargs, str):
        try:
            kwargs = json.loads(kwargs)
        except json.JSONDecodeError as exc:
            raise ValueError(f"mm_processor_kwargs is not valid JSON: {exc}") from None
    if kwargs is not None and not isinstance(kwargs, dict):
        raise ValueError(f"mm_processor_kwargs must be an object, got {kwargs!r}.")
    return allowed_local_media_path, domains, kwargs
