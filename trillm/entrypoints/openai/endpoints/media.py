"""A chat's ``image_url`` content parts: each becomes an ``{"type": "image"}`` part in its
message (where the part was; the chat template, or stage 2 where the template takes strings,
writes the model's placeholder: ``trillm/engine/chat_template.py``) and an
``ImageSource`` for ``multi_modal_data``, which stage 3 opens off the event loop
(``trillm/engine/media.py``: ``data:`` URLs, ``file://`` under ``--allowed-local-media-path``,
``http(s)`` within the fetch limits and ``--allowed-media-domains``). ``input_audio`` and
``audio_url`` parts become ``{"type": "audio"}`` parts and ``AudioSource``s alike; a
``video_url`` part (Qwen2-VL, LLaVA-OneVision) becomes its placeholder's text and a
``VideoSource`` (its frames chosen by the request's ``media_io_kwargs``)."""

from __future__ import annotations

from typing import Any

import attrs

from trillm.engine.chat_media import audio_part_source
from trillm.engine.chat_template import AUDIO_PART, IMAGE_PART
from trillm.engine.media import AUDIO_PARTS, ImageSource, MultiModalInputError
from trillm.engine.media_io import video_loading
from trillm.engine.preprocess import Preprocessor
from trillm.engine.video_decode import VideoSource
from trillm.entrypoints.openai.http.errors import BadRequestError
from trillm.entrypoints.openai.schemas.protocol import ChatMessage


def has_images(messages: list[ChatMessage]) -> bool:
    return any(
        isinstance(m.content, list) and any(p.type == "image_url" for p in m.content)
        for m in messages
    )


def split_images(
    pre: Preprocessor, messages: list[ChatMessage]
) -> tuple[list[ChatMessage], list[Any]]:
    """(the messages with each image part as ``{"type": "image"}``, their sources)."""
    if pre.multimodal is None:
        return messages, []  # stage 2 refuses the parts, naming them
    out: list[ChatMessage] = []
    images: list[Any] = []
    for i, m in enumerate(messages):
        if not isinstance(m.content, list):
            out.append(m)
            continue
        parts: list[Any] = []
        for j, part in enumerate(m.content):
            if part.type in AUDIO_PARTS:
                param = f"messages[{i}].content[{j}].{part.type}"
                images.append(_audio_source(part, param))
                parts.append({"type": AUDIO_PART})
                continue
            if part.type == "video_url":
                param = f"messages[{i}].content[{j}].video_url"
                source, placeholder = _video_source(pre, part, param)
                images.append(source)
                # NOTE: the model's placeholder as text: the chat template never sees a video
                parts.append({"type": "text", "text": placeholder})
                continue
            if part.type != "image_url":
                parts.append(part)
                continue
            param = f"messages[{i}].content[{j}].image_url"
            if part.image_url is None or part.image_url.url is None:
                raise BadRequestError("An image_url part needs its image_url.url.", param)
            images.append(ImageSource(part.image_url.url, param))
            parts.append({"type": IMAGE_PART})  # the template's (or the placeholder text)
        out.append(attrs.evolve(m, content=parts))
    return out, images


def _video_source(pre: Preprocessor, part: Any, param: str) -> tuple[VideoSource, str]:
    """A ``video_url`` part's source and placeholder, for a model that takes videos."""
    placeholder = getattr(pre.multimodal, "video_placeholder", None)
    if placeholder is None:
        arch = pre.model_config.architecture
        raise BadRequestError(f"{arch} takes no video inputs (video_url).", param)
    if part.video_url is None or part.video_url.url is None:
        raise BadRequestError("A video_url part needs its video_url.url.", param)
    return VideoSource(part.video_url.url, param), placeholder


def with_media_io(sources: list[Any], kwargs: dict[str, Any] | None) -> list[Any]:
    """The chat's media sources, each video's with the request's ``media_io_kwargs``
    (checked even without a video: what cannot apply is refused by name)."""
    try:
        loading = video_loading(kwargs)
    except MultiModalInputError as exc:
        raise BadRequestError(str(exc), exc.param) from None
    return [attrs.evolve(s, loading=loading) if isinstance(s, VideoSource) else s for s in sources]


def _audio_source(part: Any, param: str) -> Any:
    try:
        return audio_part_source(getattr(part, part.type), part.type, param)
    except MultiModalInputError as exc:
        raise BadRequestError(str(exc), exc.param) from None


def check_mm_kwargs(pre: Preprocessor, kwargs: dict[str, Any] | None) -> None:
    """A request's ``mm_processor_kwargs`` without images: its keys checked all the same."""
    if kwargs is None:
        return
    if pre.multimodal is None:
        raise BadRequestError(
            "mm_processor_kwargs: this model takes no image inputs.", "mm_processor_kwargs"
        )
    try:
        pre.multimodal.check_kwargs(kwargs, "mm_processor_kwargs")
    except MultiModalInputError as exc:
        raise BadRequestError(str(exc), exc.param) from None
