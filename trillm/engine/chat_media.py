"""A Python caller's chat and its media: which content parts carry images, audio and videos,
and the sources they name grouped as ``multi_modal_data`` (the sources are opened by stage 3
through ``media.MediaConnector``)."""

from __future__ import annotations

from typing import Any

from trillm.engine.chat_template import AUDIO_PART, IMAGE_PART
from trillm.engine.media import (
    AUDIO_PARTS,
    AudioSource,
    ImageSource,
    MultiModalInputError,
    input_audio_source,
)
from trillm.engine.video_decode import VideoSource


def split_chat_images(
    messages: list[Any], video_placeholder: str | None = None
) -> tuple[list[Any], list[Any]]:
    """A Python caller's chat (dict messages): each ``image_url`` part (its URL opened by stage
    3) and ``image_pil`` part (vLLM's ``{"type": "image_pil", "image_pil": image}``) becomes an
    ``{"type": "image"}`` part where it stands (the chat template writes the model's
    placeholder, or stage 2 does: ``chat_template.py``), each ``input_audio`` / ``audio_url``
    part an ``{"type": "audio"}`` part, each ``video_url`` part the model's
    ``video_placeholder`` as text (as the HTTP chat writes it; None: the model takes no
    videos). Returns (the messages, the sources in order:
    ``multi_modal_data`` groups them)."""
    out: list[Any] = []
    images: list[Any] = []
    for i, m in enumerate(messages):
        content = m.get("content") if isinstance(m, dict) else None
        if not isinstance(content, list):
            out.append(m)
            continue
        parts: list[Any] = []
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            param = f"messages[{i}].content[{j}].{kind}"
            if kind == "image_url":
                spec = part.get("image_url")
                url = spec.get("url") if isinstance(spec, dict) else spec
                if not isinstance(url, str):
                    raise MultiModalInputError("An image_url part needs its image_url.url.", param)
                images.append(ImageSource(url, param))
            elif kind == "image_pil":
                images.append(part.get("image_pil"))  # stage 3 checks it is a PIL image
            elif kind == "video_url":
                images.append(video_part_source(part.get(kind), video_placeholder, param))
                # NOTE: the model's placeholder as text: the chat template never sees a video
                parts.append({"type": "text", "text": video_placeholder})
                continue
            elif kind in AUDIO_PARTS:
                images.append(audio_part_source(part.get(kind), kind, param))
                parts.append({"type": AUDIO_PART})
                continue
            else:
                parts.append(part)
                continue
            parts.append({"type": IMAGE_PART})  # the template's (or the placeholder text)
        out.append({**m, "content": parts})
    return out, images


def video_part_source(spec: Any, placeholder: str | None, param: str) -> VideoSource:
    """A ``video_url`` part's ``{"url"}``, for a model that takes videos."""
    if placeholder is None:
        raise MultiModalInputError("This model takes no video inputs (video_url).", param)
    url = spec.get("url") if isinstance(spec, dict) else spec
    if not isinstance(url, str):
        raise MultiModalInputError("A video_url part needs its video_url.url.", param)
    return VideoSource(url, param)


def audio_part_source(spec: Any, kind: str, param: str) -> AudioSource:
    """An ``input_audio`` part's ``{"data", "format"}`` or an ``audio_url`` part's ``{"url"}``
    (a dict or the HTTP schema's object)."""
    if kind == "input_audio":
        return input_audio_source(spec, param)
    url = spec.get("url") if isinstance(spec, dict) else getattr(spec, "url", spec)
    if not isinstance(url, str):
        raise MultiModalInputError("An audio_url part needs its audio_url.url.", param)
    return AudioSource(param, url=url)


def multi_modal_data(sources: list[Any]) -> dict[str, list[Any]]:
    """A chat's media sources in order as ``multi_modal_data``, each under its modality."""
    data: dict[str, list[Any]] = {}
    for source in sources:  # an image source: an ImageSource or a PIL image
        data.setdefault(getattr(source, "modality", "image"), []).append(source)
    return data
