"""Stage 3 for audio (Qwen2-Audio): ``{"prompt": ..., "multi_modal_data": {"audio": ...}}``.

An item is ``(samples, sample_rate)`` (vLLM's shape; a bare 1-D array is taken at the model's
rate, as vLLM takes it) or, from a chat, an ``AudioSource``: an ``input_audio`` part's base64
WAV or an ``audio_url`` (``data:``, ``file://`` under ``--allowed-local-media-path``,
``http(s)`` within the image fetch limits), decoded by ``audio_decode.py``. The count is
checked against ``limit_mm_per_prompt``, the duration against the encoder's window (the
feature extractor's ``chunk_length``, 30 s for Qwen2-Audio: longer audio is refused, not
truncated) before any sample is converted; each clip is resampled to the extractor's rate and
turned into log-mel features by the folder's Whisper feature extractor, in a tokenization
thread, exactly as transformers' ``Qwen2AudioProcessor`` calls it. Each ``<|AUDIO|>`` of the
prompt is expanded to one token per encoder output row, and each clip becomes a
``MultiModalItem`` whose data is its features [mel, L + 2] (``models/qwen2_audio.py``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import trio

from trillm.config import TrillmConfig
from trillm.engine import audio_decode, audio_mp3
from trillm.engine.media import (
    AudioSource,
    MediaConnector,
    MultiModalInputError,
    b64decode,
    content_hash,
)
from trillm.messages import MultiModalItem
from trillm.model_executor.qwen2_audio_config import CONTEXT_FRAMES, audio_token_id, audio_tokens


def load_feature_extractor(folder: str) -> Any:
    """The folder's Whisper feature extractor (``preprocessor_config.json``)."""
    from transformers import WhisperFeatureExtractor

    path = Path(folder) / "preprocessor_config.json"
    if not path.is_file():
        raise ValueError(f"The model folder {folder!r} has no preprocessor_config.json.")
    data = json.loads(path.read_text(encoding="utf-8"))
    kind = data.get("feature_extractor_type", "WhisperFeatureExtractor")
    if kind != "WhisperFeatureExtractor":
        raise ValueError(
            f"The feature extractor {kind!r} is not supported (WhisperFeatureExtractor)."
        )
    if data.get("dither", 0.0):
        raise ValueError("The feature extractor's dither (random noise) is not supported.")
    return WhisperFeatureExtractor.from_pretrained(folder)


def decode_bytes(raw: bytes, param: str, rate: int, max_samples: int) -> np.ndarray:
    """A WAV (or MP3) file -> mono float32 samples at ``rate``; its length checked from the
    header before the samples are decoded."""
    try:
        if audio_mp3.is_mp3(raw):
            samples, source_rate = audio_mp3.read_mp3(raw, max_samples / rate)
        else:
            header = audio_decode.read_wav_header(raw)
            check_length(header.frames, header.rate, rate, max_samples, param)
            samples, source_rate = audio_decode.wav_samples(header), header.rate
    except audio_mp3.TooLong as exc:
        raise MultiModalInputError(_too_long(exc.seconds, max_samples / rate), param) from None
    except audio_decode.AudioDecodeError as exc:
        raise MultiModalInputError(f"The audio cannot be read: {exc}.", param) from None
    check_length(len(samples), source_rate, rate, max_samples, param)
    return checked_samples(audio_decode.resample(samples, source_rate, rate), param)


def _too_long(seconds: float, limit: float) -> str:
    return (
        f"The audio is {seconds:.2f} s long; this model takes at most {limit:g} s (its "
        "feature extractor's chunk_length)."
    )


def check_length(frames: int, source_rate: int, rate: int, max_samples: int, param: str) -> None:
    """Refuses a clip longer than the encoder's window, before its samples are converted."""
    if -(-frames * rate // source_rate) > max_samples:
        raise MultiModalInputError(_too_long(frames / source_rate, max_samples / rate), param)


def checked_samples(samples: np.ndarray, param: str) -> np.ndarray:
    if not np.isfinite(samples).all():
        raise MultiModalInputError("The audio has samples that are not finite.", param)
    return samples


class AudioProcessor:
    """One per engine, for a model that takes audio (Qwen2-Audio)."""

    image_placeholder: str | None = None
    audio_placeholder = "<|audio_bos|><|AUDIO|><|audio_eos|>"

    def __init__(self, config: TrillmConfig, limiter: trio.CapacityLimiter) -> None:
        mm_config = config.model.mm_config
        assert mm_config is not None
        self.architecture = config.model.architecture
        self.limit = dict(config.limit_mm_per_prompt).get("audio", 0)
        self.token_id = audio_token_id(mm_config)
        self.extractor = load_feature_extractor(config.model.model)
        self.rate = int(self.extractor.sampling_rate)
        self.max_samples = int(self.extractor.n_samples)
        self.limiter = limiter
        self.connector = MediaConnector(
            config.allowed_local_media_path, config.allowed_media_domains
        )
        self.check_kwargs(config.mm_processor_kwargs or None, "mm_processor_kwargs")

    def check_kwargs(self, kwargs: Any, param: str) -> dict[str, Any]:
        if kwargs:
            raise MultiModalInputError(
                f"{param}: not supported for {self.architecture}'s audio inputs yet.", param
            )
        return {}

    def prompt_text(self, text: str) -> str:
        return text

    async def process(
        self, ids: list[int], data: Any, kwargs: dict[str, Any] | None = None
    ) -> tuple[list[int], list[MultiModalItem]]:
        """The prompt's ids with each ``<|AUDIO|>`` expanded, and its items in prompt order."""
        self.check_kwargs(kwargs, "mm_processor_kwargs")
        clips = await self.clips(data)
        features = await trio.to_thread.run_sync(self._features, clips, limiter=self.limiter)
        slots = [i for i, t in enumerate(ids) if t == self.token_id]
        if len(slots) != len(features):
            raise MultiModalInputError(
                f"The prompt has {len(slots)} audio placeholder(s) but multi_modal_data has "
                f"{len(features)} audio clip(s); put one {self.audio_placeholder} per clip "
                "where it belongs.",
                "prompt",
            )
        out: list[int] = []
        items: list[MultiModalItem] = []
        start = 0
        for slot, values in zip(slots, features, strict=True):
            out += ids[start:slot]
            length = audio_tokens(values.shape[1] - CONTEXT_FRAMES)
            items.append(
                MultiModalItem(
                    "audio", content_hash(values), len(out), length, values.tobytes(),
                    list(values.shape),
                )
            )  # fmt: skip
            out += [self.token_id] * length
            start = slot + 1
        return out + ids[start:], items

    async def clips(self, data: Any) -> list[np.ndarray]:
        """``multi_modal_data`` -> its clips as mono float32 at the extractor's rate."""
        if not isinstance(data, dict):
            raise MultiModalInputError("multi_modal_data must be a dict like {'audio': clip}.")
        for modality in data:
            if modality != "audio":
                raise MultiModalInputError(
                    f"multi_modal_data[{modality!r}]: {self.architecture} takes audio only."
                )
        value = data.get("audio")
        clips = [] if value is None else value if isinstance(value, list) else [value]
        if len(clips) > self.limit:
            raise MultiModalInputError(
                f"multi_modal_data['audio']: {len(clips)} audio clips, at most {self.limit} "
                "per prompt (limit_mm_per_prompt)."
            )
        out = []
        for i, clip in enumerate(clips):
            param = f"multi_modal_data['audio'][{i}]"
            if isinstance(clip, AudioSource):
                out.append(await self._open(clip))
            else:
                arr, rate = self._array(clip, param)
                out.append(
                    await trio.to_thread.run_sync(
                        self._resampled, arr, rate, param, limiter=self.limiter
                    )
                )
        return out

    async def _open(self, source: AudioSource) -> np.ndarray:
        if source.url is not None:
            raw = await self.connector.read(source.url, source.param, self.limiter, "audio")
        else:
            raw = b64decode(source.data or "", source.param, "input_audio.data")
        return await trio.to_thread.run_sync(
            decode_bytes, raw, source.param, self.rate, self.max_samples, limiter=self.limiter
        )

    def _array(self, clip: Any, param: str) -> tuple[np.ndarray, int]:
        """(samples, rate) from a ``(array, sample_rate)`` tuple or a bare array."""
        arr, rate = clip if isinstance(clip, tuple) and len(clip) == 2 else (clip, self.rate)
        if not isinstance(arr, np.ndarray) or arr.ndim != 1 or arr.dtype.kind not in "fiu":
            raise MultiModalInputError(
                f"{param} must be (samples, sample_rate) with samples a 1-D numpy array of "
                f"numbers (mono), got {type(arr).__name__}."
            )
        if isinstance(rate, bool) or not isinstance(rate, int | float) or rate != int(rate):
            raise MultiModalInputError(f"{param}: the sample rate must be a whole number of Hz.")
        if not audio_decode.MIN_RATE <= rate <= audio_decode.MAX_RATE:
            raise MultiModalInputError(
                f"{param}: sample rate {rate} Hz is outside [{audio_decode.MIN_RATE}, "
                f"{audio_decode.MAX_RATE}] Hz."
            )
        check_length(len(arr), int(rate), self.rate, self.max_samples, param)
        return arr, int(rate)

    def _resampled(self, arr: np.ndarray, rate: int, param: str) -> np.ndarray:
        samples = checked_samples(arr.astype(np.float32), param)
        return audio_decode.resample(samples, rate, self.rate)

    def _features(self, clips: list[np.ndarray]) -> list[np.ndarray]:
        """Each clip's log-mel features [mel, L + 2] (its L frames and the two after)."""
        out = []
        for i, clip in enumerate(clips):
            enc = self.extractor(
                clip,
                sampling_rate=self.rate,
                return_attention_mask=True,
                padding="max_length",
                return_tensors="np",
            )
            frames = int(enc["attention_mask"][0].sum())
            if audio_tokens(frames) < 1:
                raise MultiModalInputError(
                    f"multi_modal_data['audio'][{i}] is too short ({len(clip)} samples) to "
                    "make one audio token."
                )
            values = np.zeros((enc["input_features"].shape[1], frames + CONTEXT_FRAMES), np.float32)
            kept = enc["input_features"][0, :, : frames + CONTEXT_FRAMES]
            values[:, : kept.shape[1]] = kept  # past the window: the convolution's zeros
            out.append(values)
        return out
