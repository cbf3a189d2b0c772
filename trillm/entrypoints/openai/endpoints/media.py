"""A chat's ``image_url`` content parts: each becomes the model's placeholder text in its
message (where the part was, joined to the text parts as they are joined) and an image for
``multi_modal_data``. Only ``data:`` URLs (base64 images) are taken: ``http(s)`` fetching and
``file://`` (vLLM's ``--allowed-local-media-path``) are not implemented yet and refused by
name. Bytes are decoded from base64 and the image's header read off the event loop; the
pixels are decoded later by stage 3, after its pixel budget has checked the header's size."""

from __future__ import annotations

import base64
import binascii
import io
from typing import Any

import attrs
import trio

from trillm.engine.preprocess import Preprocessor
from trillm.entrypoints.openai.http.errors import BadRequestError
from trillm.entrypoints.openai.schemas.protocol import ChatMessage, TextPart


def has_images(messages: list[ChatMessage]) -> bool:
    return any(
        isinstance(m.content, list) and any(p.type == "image_url" for p in m.content)
        for m in messages
    )


def _open_data_url(url: str, param: str) -> Any:
    """A ``data:image/...;base64,...`` URL -> a PIL image whose header alone has been read."""
    from PIL import Image, UnidentifiedImageError

    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme in ("http", "https"):
        raise BadRequestError(
            "Image URLs over http(s) are not fetched yet; send the image as a data: URL "
            "(data:image/png;base64,...).",
            param,
        )
    if scheme == "file":
        raise BadRequestError(
            "file:// image URLs need --allowed-local-media-path, which is not implemented yet; "
            "send the image as a data: URL.",
            param,
        )
    if scheme != "data":
        raise BadRequestError(
            "An image URL must be a data: URL (data:image/png;base64,...).", param
        )
    header, sep, payload = url[5:].partition(",")
    mime, _, encoding = header.partition(";")
    if not sep or encoding.lower() != "base64":
        raise BadRequestError("An image data: URL must be base64 (data:<mime>;base64,...).", param)
    if not mime.lower().startswith("image/"):
        raise BadRequestError(f"The data: URL's media type {mime!r} is not an image.", param)
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise BadRequestError("The image data: URL is not valid base64.", param) from None
    try:
        return Image.open(io.BytesIO(data))  # the header only: decoding comes later
    except Image.DecompressionBombError as exc:  # PIL's own limit, above stage 3's
        raise BadRequestError(f"The image has more pixels than the limit: {exc}", param) from None
    except (UnidentifiedImageError, OSError, ValueError) as exc:
        raise BadRequestError(f"The image data cannot be read as an image: {exc}", param) from None


def _split(messages: list[ChatMessage], placeholder: str) -> tuple[list[ChatMessage], list[Any]]:
    out: list[ChatMessage] = []
    images: list[Any] = []
    for i, m in enumerate(messages):
        if not isinstance(m.content, list):
            out.append(m)
            continue
        parts: list[TextPart] = []
        for j, part in enumerate(m.content):
            if part.type != "image_url":
                parts.append(part)
                continue
            param = f"messages[{i}].content[{j}].image_url"
            if part.image_url is None or part.image_url.url is None:
                raise BadRequestError("An image_url part needs its image_url.url.", param)
            images.append(_open_data_url(part.image_url.url, param))
            parts.append(TextPart(type="text", text=placeholder))
        out.append(attrs.evolve(m, content=parts))
    return out, images


async def split_images(
    pre: Preprocessor, messages: list[ChatMessage]
) -> tuple[list[ChatMessage], list[Any]]:
    """(the messages with each image part as the model's placeholder text, the images)."""
    if pre.multimodal is None:
        return messages, []  # stage 2 refuses the parts, naming them
    placeholder = pre.multimodal.image_placeholder
    return await trio.to_thread.run_sync(
        _split, messages, placeholder, limiter=pre.tokenize_limiter
    )
