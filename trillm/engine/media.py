"""Where a chat's images and audio come from (vLLM's names and rules), read off the event
loop (audio: the same rules with ``audio/*`` for ``image/*``, decoded by ``audio_inputs.py``):

- ``data:`` URLs (``data:image/png;base64,...``): decoded from base64;
- ``file://`` URLs only with ``allowed_local_media_path`` (``--allowed-local-media-path``):
  the path resolved (symlinks followed) must lie inside that directory, be a regular file and
  hold at most MAX_IMAGE_BYTES;
- ``http(s)`` URLs: fetched in a worker thread within ``VLLM_IMAGE_FETCH_TIMEOUT`` seconds
  (vLLM's, default 5; the whole fetch, redirects included; a video within
  ``VLLM_VIDEO_FETCH_TIMEOUT``, 30, an audio clip within ``VLLM_AUDIO_FETCH_TIMEOUT``, 10),
  at most MAX_IMAGE_BYTES, an
  ``image/*`` content type, at most MAX_REDIRECTS redirects; with ``allowed_media_domains``
  (``--allowed-media-domains``) every hop's host must be one of them (without it any host
  is fetched, as vLLM does).

Each source gives a PIL image whose header alone has been read: stage 3 checks its pixels
before decoding (``trillm/engine/multimodal.py``). Every refusal is a ``MultiModalInputError``
naming the content part (a 400 over HTTP, a ValueError in Python).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import http.client
import io
import time
import urllib.parse
import urllib.request
from functools import partial
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import trio

from trillm import envs
from trillm.engine import audio_mp3

MAX_IMAGE_BYTES = 32 * 1024 * 1024  # the most bytes one image URL or file may bring
MAX_REDIRECTS = 5
INPUT_AUDIO_FORMATS = ("wav", "mp3")  # OpenAI's (mp3: with the optional soundfile)
_FETCH_THREADS = 8  # fetches at once (they wait on the network, not the CPU)
_REDIRECTS = (301, 302, 303, 307, 308)
AUDIO_PARTS = ("input_audio", "audio_url")  # a chat's audio content parts (OpenAI's, vLLM's)


class MultiModalInputError(ValueError):
    """Bad multimodal input; ``param`` names the field (the HTTP layer answers 400)."""

    def __init__(self, message: str, param: str = "multi_modal_data") -> None:
        super().__init__(message)
        self.param = param


def placeholder_slots(ids: list[int], token_id: int, count: int, kind: str) -> list[int]:
    """Where the prompt's ``kind`` placeholders are: one per item."""
    slots = [i for i, t in enumerate(ids) if t == token_id]
    if len(slots) != count:
        raise MultiModalInputError(
            f"The prompt has {len(slots)} {kind} placeholder(s) but multi_modal_data has "
            f"{count} {kind}(s); put one placeholder per {kind} where it belongs.",
            "prompt",
        )
    return slots


@attrs.frozen
class ImageSource:
    """An ``image_url`` part's URL, opened by stage 3 (``MediaConnector.open``)."""

    url: str
    param: str  # e.g. messages[0].content[1].image_url


def content_hash(values: np.ndarray) -> str:
    """The key of an item's processed values (the encoder cache's and the prefix cache's)."""
    digest = hashlib.blake2b(digest_size=16)
    digest.update(repr((values.dtype.str, values.shape)).encode())
    digest.update(np.ascontiguousarray(values).data)
    return digest.hexdigest()


@attrs.frozen
class AudioSource:
    """A chat's audio part, decoded by stage 3: ``input_audio`` (base64 ``data``, ``format``)."""

    param: str  # e.g. messages[0].content[1].input_audio
    data: str | None = None
    format: str = "wav"
    url: str | None = None  # an ``audio_url`` part's
    modality = "audio"  # its multi_modal_data key


def input_audio_source(spec: Any, param: str) -> AudioSource:
    """An ``input_audio`` part's ``{"data": base64, "format": "wav"}`` (OpenAI's shape)."""
    data = spec.get("data") if isinstance(spec, dict) else getattr(spec, "data", None)
    fmt = spec.get("format") if isinstance(spec, dict) else getattr(spec, "format", None)
    if not isinstance(data, str):
        raise MultiModalInputError("An input_audio part needs its input_audio.data.", param)
    if fmt not in INPUT_AUDIO_FORMATS:
        raise MultiModalInputError(
            f"input_audio.format {fmt!r} is not supported; supported: "
            f"{', '.join(INPUT_AUDIO_FORMATS)}.",
            param,
        )
    if fmt == "mp3" and not audio_mp3.available():
        raise MultiModalInputError(f"input_audio.format 'mp3': {audio_mp3.MISSING}.", param)
    if len(data) > MAX_IMAGE_BYTES // 3 * 4 + 4:  # bounded before decoding
        raise MultiModalInputError(
            f"input_audio.data holds more than {MAX_IMAGE_BYTES} bytes.", param
        )
    return AudioSource(param, data=data, format=fmt)


def _short(url: str) -> str:
    return url if len(url) <= 120 else url[:117] + "..."


def open_image_bytes(data: bytes, param: str) -> Any:
    """Bytes -> a PIL image whose header alone has been read."""
    from PIL import Image, UnidentifiedImageError

    try:
        return Image.open(io.BytesIO(data))  # the header only: decoding comes later
    except Image.DecompressionBombError as exc:  # PIL's own limit, above stage 3's
        raise MultiModalInputError(
            f"The image has more pixels than the limit: {exc}", param
        ) from None
    except (UnidentifiedImageError, OSError, ValueError) as exc:
        raise MultiModalInputError(
            f"The image data cannot be read as an image: {exc}", param
        ) from None


def _data_url(url: str, param: str, kind: str = "image") -> bytes:
    header, sep, payload = url[5:].partition(",")
    mime, _, encoding = header.partition(";")
    if not sep or encoding.lower() != "base64":
        raise MultiModalInputError(
            f"An {kind} data: URL must be base64 (data:<mime>;base64,...).", param
        )
    if not mime.lower().startswith(f"{kind}/"):
        raise MultiModalInputError(f"The data: URL's media type {mime!r} is not {_a(kind)}.", param)
    if len(payload) > MAX_IMAGE_BYTES // 3 * 4 + 4:  # its bytes bounded before decoding
        raise MultiModalInputError(
            f"The {kind} data: URL holds more than {MAX_IMAGE_BYTES} bytes.", param
        )
    return b64decode(payload, param, f"The {kind} data: URL")


def _a(kind: str) -> str:
    return f"an {kind}" if kind[0] in "aeiou" else f"a {kind}"


def b64decode(payload: str, param: str, what: str) -> bytes:
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise MultiModalInputError(f"{what} is not valid base64.", param) from None


class MediaConnector:
    """Opens image URLs by the engine's media settings (one per engine)."""

    def __init__(
        self,
        allowed_local_media_path: str = "",
        allowed_media_domains: list[str] | None = None,
    ) -> None:
        self.local_root = (
            Path(allowed_local_media_path).resolve(strict=True)
            if allowed_local_media_path
            else None
        )
        self.domains = (
            None if allowed_media_domains is None else {d.lower() for d in allowed_media_domains}
        )
        # seconds an http(s) fetch of each kind may take, and the variable that says so
        self.fetch_timeouts = {
            kind: (float(var.get()), var.names[0])
            for kind, var in (
                ("image", envs.IMAGE_FETCH_TIMEOUT),
                ("video", envs.VIDEO_FETCH_TIMEOUT),
                ("audio", envs.AUDIO_FETCH_TIMEOUT),
            )
        }
        self.fetch_limiter = trio.CapacityLimiter(_FETCH_THREADS)

    async def open(self, source: ImageSource, limiter: trio.CapacityLimiter) -> Any:
        """The source's image (header read)."""
        data = await self.read(source.url, source.param, limiter)
        return await trio.to_thread.run_sync(open_image_bytes, data, source.param, limiter=limiter)

    async def read(
        self, url: str, param: str, limiter: trio.CapacityLimiter, kind: str = "image"
    ) -> bytes:
        """The bytes of an ``kind`` URL; http(s) within the fetch timeout, whatever the server
        does (a hanging thread is abandoned and ends at its own deadline)."""
        scheme = url.split(":", 1)[0].lower() if ":" in url else ""
        if scheme not in ("http", "https"):
            return await trio.to_thread.run_sync(self.read_local, url, param, kind, limiter=limiter)
        timeout = self.fetch_timeouts[kind][0]
        deadline = time.monotonic() + timeout
        data: bytes | None = None
        with trio.move_on_after(timeout + 0.1):
            data = await trio.to_thread.run_sync(
                partial(self._fetch, url, param, deadline, kind),
                limiter=self.fetch_limiter,
                abandon_on_cancel=True,
            )
        if data is None:
            raise MultiModalInputError(self._timed_out(url, kind), param)
        return data

    def read_local(self, url: str, param: str, kind: str = "image") -> bytes:
        """A ``data:`` or ``file://`` URL's bytes (blocking)."""
        scheme = url.split(":", 1)[0].lower() if ":" in url else ""
        if scheme == "data":
            return _data_url(url, param, kind)
        if scheme == "file":
            return self._read_file(url, param, kind)
        raise MultiModalInputError(
            f"An {kind} URL must be a data: URL (data:{kind}/...;base64,...), an http(s) URL "
            "or a file:// URL (with --allowed-local-media-path).",
            param,
        )

    # ------------------------------------------------------------------ file://
    def _read_file(self, url: str, param: str, kind: str) -> bytes:
        if self.local_root is None:
            raise MultiModalInputError(
                f"file:// {kind} URLs need --allowed-local-media-path (allowed_local_media_path) "
                "naming the directory they may come from.",
                param,
            )
        parts = urllib.parse.urlsplit(url)
        if parts.netloc not in ("", "localhost"):
            raise MultiModalInputError(f"A file:// URL names no host; got {parts.netloc!r}.", param)
        path = Path(urllib.request.url2pathname(parts.path))
        try:
            resolved = path.resolve(strict=True)  # symlinks followed: where it really is
        except (OSError, RuntimeError):
            raise MultiModalInputError(
                f"The {kind} file {str(path)!r} does not exist.", param
            ) from None
        if self.local_root not in resolved.parents:
            raise MultiModalInputError(
                f"The {kind} file {str(path)!r} is not inside --allowed-local-media-path "
                f"{str(self.local_root)!r}.",
                param,
            )
        if not resolved.is_file():
            raise MultiModalInputError(
                f"The {kind} path {str(path)!r} is not a regular file.", param
            )
        with open(resolved, "rb") as f:
            data = f.read(MAX_IMAGE_BYTES + 1)
        if len(data) > MAX_IMAGE_BYTES:
            raise MultiModalInputError(
                f"The {kind} file {str(path)!r} is larger than {MAX_IMAGE_BYTES} bytes.", param
            )
        return data

    # ------------------------------------------------------------------ http(s)
    def _timed_out(self, url: str, kind: str) -> str:
        timeout, variable = self.fetch_timeouts[kind]
        return (
            f"Fetching the {kind} URL {_short(url)!r} took longer than {timeout:g} s ({variable})."
        )

    def _check_host(self, url: str, param: str, kind: str) -> urllib.parse.SplitResult:
        parts = urllib.parse.urlsplit(url)
        try:
            parts.port  # noqa: B018 (a port that is not a number raises here)
        except ValueError:
            raise MultiModalInputError(
                f"The {kind} URL {_short(url)!r} has a bad port.", param
            ) from None
        if parts.scheme.lower() not in ("http", "https") or not parts.hostname:
            raise MultiModalInputError(
                f"The {kind} URL {_short(url)!r} is not an http(s) URL.", param
            )
        if self.domains is not None and parts.hostname not in self.domains:
            raise MultiModalInputError(
                f"The {kind} URL {_short(url)!r}: its host {parts.hostname!r} is not one of "
                "--allowed-media-domains.",
                param,
            )
        return parts

    def _fetch(self, url: str, param: str, deadline: float, kind: str = "image") -> bytes:
        """GET the URL (blocking): redirects followed (each hop's host checked), the body read
        up to MAX_IMAGE_BYTES, every socket wait bounded by what is left of the deadline."""
        for _ in range(MAX_REDIRECTS + 1):
            parts = self._check_host(url, param, kind)
            left = deadline - time.monotonic()
            if left <= 0:
                raise MultiModalInputError(self._timed_out(url, kind), param)
            cls = (
                http.client.HTTPSConnection
                if parts.scheme.lower() == "https"
                else http.client.HTTPConnection
            )
            conn = cls(parts.hostname or "", parts.port, timeout=left)
            try:
                target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
                conn.request("GET", target, headers={"Accept": f"{kind}/*", "User-Agent": "trillm"})
                resp = conn.getresponse()
                if resp.status in _REDIRECTS:
                    location = resp.getheader("Location")
                    if not location:
                        raise MultiModalInputError(
                            f"The {kind} URL {_short(url)!r} redirects without a Location.", param
                        )
                    url = urllib.parse.urljoin(url, location)
                    continue
                return self._body(conn, resp, url, param, deadline, kind)
            except (OSError, http.client.HTTPException) as exc:
                if time.monotonic() >= deadline:
                    raise MultiModalInputError(self._timed_out(url, kind), param) from None
                raise MultiModalInputError(
                    f"Fetching the {kind} URL {_short(url)!r} failed: {exc}", param
                ) from None
            finally:
                conn.close()
        raise MultiModalInputError(
            f"The {kind} URL redirects more than {MAX_REDIRECTS} times.", param
        )

    def _body(
        self, conn: Any, resp: Any, url: str, param: str, deadline: float, kind: str
    ) -> bytes:
        if resp.status != 200:
            raise MultiModalInputError(
                f"Fetching the {kind} URL {_short(url)!r} answered HTTP {resp.status}.", param
            )
        ctype = (resp.getheader("Content-Type") or "").split(";")[0].strip().lower()
        if not ctype.startswith(f"{kind}/"):
            raise MultiModalInputError(
                f"The {kind} URL {_short(url)!r} has content type {ctype or 'none'!r}, not "
                f"{_a(kind)}.",
                param,
            )
        length = resp.getheader("Content-Length")
        too_big = f"The {kind} URL {_short(url)!r} brings more than {MAX_IMAGE_BYTES} bytes."
        if length is not None and length.strip().isdigit() and int(length) > MAX_IMAGE_BYTES:
            raise MultiModalInputError(too_big, param)
        chunks: list[bytes] = []
        size = 0
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise MultiModalInputError(self._timed_out(url, kind), param)
            if conn.sock is not None:
                conn.sock.settimeout(left)
            chunk = resp.read1(1 << 16)
            if not chunk:
                return b"".join(chunks)
            size += len(chunk)
            if size > MAX_IMAGE_BYTES:
                raise MultiModalInputError(too_big, param)
            chunks.append(chunk)
