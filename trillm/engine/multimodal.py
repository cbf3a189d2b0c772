"""Stage 3, multimodal inputs: ``{"prompt": ..., "multi_modal_data": {"image": ...}}``.

Each image is checked (a PIL image; its pixels from the header against ``max_pixels`` before
decoding; the count against ``limit_mm_per_prompt``), then processed by the folder's image
processor (transformers' PIL path: no torchvision) in a thread, bounded like tokenization;
videos alike (``video_decode.py``; ``video_inputs.py`` for Qwen2-VL, ``onevision_video.py``).
Each placeholder (LLaVA's ``<image>``) is expanded to one token per feature row, as the Hugging
Face processor does, and each item becomes a ``MultiModalItem``: its pixel values as bytes, its
placeholder range, a content hash keying the encoder cache and the prefix cache.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from functools import partial
from typing import TYPE_CHECKING, Any

import numpy as np
import trio

from trillm.config import TrillmConfig
from trillm.engine import gemma3_inputs as gemma3
from trillm.engine import llama4_inputs as llama4
from trillm.engine import onevision_inputs as onevision
from trillm.engine import onevision_video, video_decode
from trillm.engine import qwen2_vl_inputs as qwen2_vl
from trillm.engine import video_inputs as video
from trillm.engine.audio_inputs import AudioProcessor
from trillm.engine.image_processors import check_keywords, load_image_processor
from trillm.engine.media import (
    ImageSource,
    MediaConnector,
    MultiModalInputError,
    content_hash,
    placeholder_slots,
)
from trillm.engine.mm_processor_cache import ProcessorCache, item_key
from trillm.engine.onevision_video import video_token, video_tokens
from trillm.engine.video_sampling import without_frame_kwargs
from trillm.messages import MultiModalItem
from trillm.model_executor.gemma3_mm_config import is_gemma3_mm
from trillm.model_executor.llama4_vision_config import is_llama4_mm
from trillm.model_executor.multimodal_config import image_token_id, num_image_tokens
from trillm.model_executor.onevision_config import is_onevision
from trillm.model_executor.qwen2_audio_config import is_qwen2_audio
from trillm.model_executor.qwen2_vl_config import is_qwen2_vl

if TYPE_CHECKING:
    from trillm.tokenizer_protocol import Tokenizer

# The most pixels one image may have (its header is read first: decompression bombs are
# refused before decoding). PIL's own bomb limit is higher (~89 M).
MAX_IMAGE_PIXELS = 4096 * 4096
_GEOMETRY_KWARGS = ("size", "crop_size", "pad_size")
# The longest side over the shortest an image may have (Qwen2-VL's processor's bound): the
# processor scales the short side to the tower's, and the long side with it.
MAX_ASPECT_RATIO = 200


class MultiModalProcessor:
    """One per engine, for a model that takes images (``TrillmConfig.limit_mm_per_prompt``)."""

    audio_placeholder: str | None = None  # (audio models: ``AudioProcessor``)

    def __init__(self, config: TrillmConfig, tokenizer: Tokenizer, limiter: trio.CapacityLimiter):
        mm_config = config.model.mm_config
        assert mm_config is not None
        self.mm_config = mm_config
        self.folder = config.model.model
        self.limits = dict(config.limit_mm_per_prompt)
        self.architecture = config.model.architecture
        self.image_token_id = image_token_id(mm_config)
        # What a chat's image part becomes in the prompt text (LLaVA's "<image>")
        self.image_placeholder = str(tokenizer.convert_ids_to_tokens(self.image_token_id))
        self.qwen2_vl = is_qwen2_vl(mm_config)
        self.onevision = is_onevision(mm_config)  # any-resolution tiles
        self.modalities = ("image", "video") if self.qwen2_vl or self.onevision else ("image",)
        self.video_token_id = int(mm_config.get("video_token_id") or -1)  # Qwen2-VL's
        self.video_placeholder: str | None = None  # what a chat's video part becomes
        if self.onevision:  # "<video>"
            self.video_token_id, self.video_placeholder = video_token(mm_config, tokenizer)
        if self.qwen2_vl:
            self.image_placeholder = qwen2_vl.image_placeholder(
                mm_config, tokenizer, self.image_token_id
            )
            placeholder = qwen2_vl.image_placeholder(mm_config, tokenizer, self.video_token_id)
            self.video_placeholder = placeholder
        # The placeholder's id in the prompt, and the ids around an image's feature tokens
        self.slot_id = self.image_token_id
        self.before: list[int] = []
        self.after: list[int] = []
        self.gemma3 = is_gemma3_mm(mm_config)
        self.end_id: int | None = None  # Gemma 3's <end_of_image>, after prompt_text
        self.end_text = ""
        if self.gemma3:
            self.slot_id, self.before, self.after = gemma3.expansion(mm_config, tokenizer)
            self.image_placeholder = str(tokenizer.convert_ids_to_tokens(self.slot_id))
            self.end_id = self.after[0]
            self.end_text = str(tokenizer.convert_ids_to_tokens(self.end_id))
        self.max_pixels = MAX_IMAGE_PIXELS
        self.limiter = limiter
        self._image_processor: Any = None
        self.llama4 = (
            llama4.Llama4Expansion(mm_config, tokenizer) if is_llama4_mm(mm_config) else None
        )
        if self.llama4 is not None:  # <|image|> -> <|image_start|> tiles <|image_end|>
            self.slot_id, self.before, self.after = self.llama4.slots
            self.image_placeholder = llama4.IMAGE
            self._image_processor = llama4.load_processor(self.folder, mm_config)
        if self.onevision:  # its tiling (and its video processor's size) checked at start
            self._image_processor = onevision.load_processor(self.folder, mm_config)
            if self.limits.get("video"):
                self.video_processing = onevision_video.load_processing(self.folder, mm_config)
        self.connector = MediaConnector(
            config.allowed_local_media_path, config.allowed_media_domains
        )
        self.processor_kwargs = self.check_kwargs(config.mm_processor_kwargs, "mm_processor_kwargs")
        # Processed images by pixels and keywords (None: --mm-processor-cache-gb 0)
        self.cache = ProcessorCache.from_gb(config.mm_processor_cache_gb)

    @property
    def image_processor(self) -> Any:
        if self._image_processor is None:
            self._image_processor = load_image_processor(self.folder)
        return self._image_processor

    def check_kwargs(self, kwargs: Any, param: str) -> dict[str, Any]:
        """``mm_processor_kwargs``: each key one the image processor takes (vLLM's field)."""
        if kwargs is None:
            return {}
        if not isinstance(kwargs, dict):
            raise MultiModalInputError(f"{param} must be an object, got {kwargs!r}.", param)
        # Qwen2-VL: the frame keys are the video processor's (video_sampling.py)
        shown = without_frame_kwargs(kwargs) if self.qwen2_vl else kwargs
        check_keywords(self.image_processor, shown, param)
        if self.qwen2_vl:
            qwen2_vl.check_kwargs(kwargs, param, self.max_pixels)
        if self.gemma3:
            gemma3.check_kwargs(kwargs, param)
        if self.onevision:
            onevision.check_kwargs(kwargs, param)
        if self.llama4 is not None:
            llama4.check_kwargs(kwargs, param)
        side = int(self.mm_config["vision_config"].get("image_size", 0)) or None
        for key in _GEOMETRY_KWARGS:  # sizes bound what resizing, cropping, padding allocate
            sizes = kwargs.get(key)
            values = list(sizes.values()) if isinstance(sizes, dict) else [sizes]
            if sizes is not None and side is not None:
                if not all(isinstance(v, int) and 0 < v <= side for v in values):
                    raise MultiModalInputError(
                        f"{param}[{key!r}]: sizes are whole numbers in [1, {side}] (the vision "
                        f"tower's side), got {sizes!r}.",
                        param,
                    )
        return dict(kwargs)

    def prompt_text(self, text: str) -> str:
        """A prompt text with images, as the model's processor writes it before tokenizing
        (Gemma 3: newlines and the end token around each image)."""
        if not self.gemma3:
            return text
        return gemma3.prompt_text(text, self.image_placeholder, self.end_text)

    async def images(self, data: Any) -> list[Any]:
        """``multi_modal_data`` -> its images: the count checked, URLs opened (their headers
        read), each a PIL image whose pixels (from the header) are within the budget."""
        from PIL import Image

        if not isinstance(data, dict):
            raise MultiModalInputError("multi_modal_data must be a dict like {'image': image}.")
        for modality in data:
            if modality not in self.modalities:
                raise MultiModalInputError(
                    f"multi_modal_data[{modality!r}]: {self.architecture} takes no "
                    f"{modality} inputs (it takes {' and '.join(self.modalities)})."
                )
        value = data.get("image")
        images = [] if value is None else value if isinstance(value, list) else [value]
        limit = self.limits.get("image", 0)
        if len(images) > limit:
            raise MultiModalInputError(
                f"multi_modal_data['image']: {len(images)} images, at most {limit} per prompt "
                "(limit_mm_per_prompt)."
            )
        images = list(images)
        for i, image in enumerate(images):  # chat image_url parts: opened now, off the loop
            if isinstance(image, ImageSource):
                images[i] = await self.connector.open(image, self.limiter)
        for i, image in enumerate(images):
            if not isinstance(image, Image.Image):
                raise MultiModalInputError(
                    f"multi_modal_data['image'][{i}] is not an image (a PIL.Image.Image), got "
                    f"{type(image).__name__}."
                )
            width, height = image.size  # from the header: nothing decoded yet
            if width * height > self.max_pixels:
                raise MultiModalInputError(
                    f"multi_modal_data['image'][{i}] has {width}x{height} pixels, more than the "
                    f"limit of {self.max_pixels}."
                )
            # NOTE: resizing the short side up multiplies the pixels by the aspect ratio
            if max(width, height) > MAX_ASPECT_RATIO * max(1, min(width, height)):
                raise MultiModalInputError(
                    f"multi_modal_data['image'][{i}] is {width}x{height} pixels, an aspect "
                    f"ratio over {MAX_ASPECT_RATIO}."
                )
        return images

    async def videos(self, data: Any, kwargs: dict[str, Any]) -> list[tuple[np.ndarray, float]]:
        """``multi_modal_data["video"]`` -> each video's patches and M-RoPE time interval: the
        count and sizes checked first (``video_decode.open_videos``), then processed in a
        tokenization thread."""
        if data.get("video") is None:
            return []
        limit = self.limits.get("video", 0)
        # frames per temporal patch: Qwen2-VL's processors; a model without videos (limit 0)
        # refuses any by their count before they are grouped
        tp = int(getattr(self.image_processor, "temporal_patch_size", 1))
        args = (limit, self.connector, self.limiter, self.max_pixels, kwargs, tp)
        clips = await video_decode.open_videos(data.get("video"), *args)
        if not clips:
            return []
        if self.onevision:  # each frame's pixel values (Qwen2-VL: temporal patches)
            work = partial(onevision_video.clip_values, self.video_processing, clips, kwargs)
        else:
            kwargs = qwen2_vl.processor_kwargs(self.image_processor, kwargs)
            work = partial(video.clip_values, self.image_processor, self.mm_config, clips, kwargs)
        return await trio.to_thread.run_sync(work, limiter=self.limiter)

    def _video_item(self, values: np.ndarray, offset: int, interval: float) -> MultiModalItem:
        length = self.item_length(values)
        return MultiModalItem(
            "video", content_hash(values), offset, length, values.tobytes(), list(values.shape),
            interval,
        )  # fmt: skip

    def _pixel_values(self, images: list[Any], kwargs: dict[str, Any]) -> list[np.ndarray]:
        out = []
        if self.qwen2_vl:
            kwargs = qwen2_vl.processor_kwargs(self.image_processor, kwargs)
        for i, image in enumerate(images):
            try:
                rgb = image.convert("RGB")  # decodes
            except (OSError, ValueError, SyntaxError) as exc:  # PIL: truncated, corrupt
                raise MultiModalInputError(
                    f"multi_modal_data['image'][{i}] cannot be decoded: {exc}"
                ) from None
            if self.cache is None:
                out.append(self._processed(rgb, kwargs))
                continue
            key = item_key(np.asarray(rgb), kwargs)
            values = self.cache.get(key)
            if values is None:
                values = self._processed(rgb, kwargs)
                self.cache.put(key, values)
            out.append(values)
        return out

    def _processed(self, rgb: Any, kwargs: dict[str, Any]) -> np.ndarray:
        """One decoded image through the image processor: its pixel values (Qwen2-VL: its
        patches)."""
        try:
            processed = self.image_processor(images=rgb, return_tensors="np", **kwargs)
        except Exception as exc:  # a value the processor refuses (transformers' checks)
            if not kwargs:
                raise
            raise MultiModalInputError(
                f"mm_processor_kwargs: the image processor refused them: {exc}",
                "mm_processor_kwargs",
            ) from None
        if self.qwen2_vl:
            return qwen2_vl.patches(processed)
        if self.onevision:
            return onevision.item_values(processed)
        if self.llama4 is not None:
            return self.llama4.item_values(processed)
        batch = processed["pixel_values"]
        side = self.mm_config["vision_config"].get("image_size")
        if side is not None and tuple(batch.shape[-2:]) != (side, side):
            raise MultiModalInputError(
                f"mm_processor_kwargs: the processed image is {batch.shape[-2]}x"
                f"{batch.shape[-1]} pixels; the vision tower takes {side}x{side}.",
                "mm_processor_kwargs",
            )
        return np.ascontiguousarray(batch[0], dtype=np.float32)

    def item_length(self, values: np.ndarray) -> int:
        """Placeholder tokens of one processed item (OneVision's from its size and grid)."""
        if self.llama4 is not None:  # its tiles and separators
            return len(self.llama4.span(values))
        if self.onevision:  # an image's tiles flattened, a video's frames [T, 3, S, S]
            count = video_tokens if values.ndim == 4 else onevision.image_tokens
            return count(self.mm_config, values)
        return num_image_tokens(self.mm_config, list(values.shape))

    async def process(
        self, ids: list[int], data: Any, kwargs: dict[str, Any] | None = None
    ) -> tuple[list[int], list[MultiModalItem]]:
        """The prompt's ids with each placeholder expanded, and its items in prompt order;
        ``kwargs``: the request's ``mm_processor_kwargs`` (over the engine's)."""
        merged = {**self.processor_kwargs, **self.check_kwargs(kwargs, "mm_processor_kwargs")}
        images = await self.images(data)
        pixels = await trio.to_thread.run_sync(
            self._pixel_values, images, merged, limiter=self.limiter
        )
        videos = await self.videos(data, merged)  # [(patches, M-RoPE time interval)]
        slots = placeholder_slots(ids, self.slot_id, len(pixels), "image")
        entries = [(slot, values, 1.0) for slot, values in zip(slots, pixels, strict=True)]
        video_slots = placeholder_slots(ids, self.video_token_id, len(videos), "video")
        entries += [(slot, *v) for slot, v in zip(video_slots, videos, strict=True)]
        entries.sort(key=lambda entry: entry[0])
        out: list[int] = []
        items: list[MultiModalItem] = []
        start = 0
        for slot, values, interval in entries:
            if ids[slot] == self.video_token_id:  # Qwen2-VL: <|video_pad|> expanded alone
                out += ids[start:slot]
                items.append(self._video_item(values, len(out), interval))
                out += [self.video_token_id] * items[-1].length
                start = slot + 1
                continue
            before, after, skip = self.before, self.after, 1
            if self.end_id is not None and gemma3.is_expanded(ids, slot, self.end_id):
                before, after, skip = [self.slot_id], [self.end_id], 2  # newlines in the text
            out += ids[start:slot] + before
            length = self.item_length(values)
            items.append(
                MultiModalItem(
                    "image", content_hash(values), len(out), length, values.tobytes(),
                    list(values.shape),
                )
            )  # fmt: skip
            fill = self.llama4.span(values) if self.llama4 else [self.image_token_id] * length
            out += fill + after
            start = slot + skip
        out += ids[start:]
        return out, items


Processor = MultiModalProcessor | AudioProcessor


def processor_for(
    config: TrillmConfig, tokenizer: Tokenizer, limiter: trio.CapacityLimiter
) -> Processor | None:
    """The engine's processor (None: a text-only model)."""
    mm_config = config.model.mm_config
    if mm_config is None or not any(config.limit_mm_per_prompt.values()):
        return None
    if is_qwen2_audio(mm_config):
        return AudioProcessor(config, limiter)
    return MultiModalProcessor(config, tokenizer, limiter)


def content_options(content_format: str, processor: Processor | None) -> dict[str, Any]:
    """How a chat's content reaches the template (``render_template``'s keywords): vLLM's
    content format, and what an image (audio) part is in the "string" one (None: refused)."""
    return {
        "content_format": content_format,
        "image_placeholder": None if processor is None else processor.image_placeholder,
        "audio_placeholder": None if processor is None else processor.audio_placeholder,
    }


def processor_text(processor: Processor | None, text: str) -> str:
    """A prompt text with images as the model's processor writes it before tokenizing
    (Gemma 3: newlines around each image)."""
    return text if processor is None else processor.prompt_text(text)


# ``Preprocessor.prompt_token_ids``: (prompt, truncating) -> (its text, its token ids)
PromptTokenizer = Callable[[str | dict[str, Any], bool], Awaitable[tuple[str | None, list[int]]]]


async def prompt_ids(
    processor: Processor | None,
    tokenize: PromptTokenizer,
    prompt: str | dict[str, Any],
    truncating: bool,
) -> tuple[str | None, list[int]]:
    """``tokenize``'s ids of a prompt, the text of a prompt dict with images as the model's
    processor writes it (``processor_text``); the text returned is the caller's."""
    given = None
    if isinstance(prompt, dict):
        given = prompt.get("prompt")
        media = prompt.get("multi_modal_data") is not None
        if isinstance(given, str) and media and "prompt_token_ids" not in prompt:
            prompt = {**prompt, "prompt": processor_text(processor, given)}
    text, ids = await tokenize(prompt, truncating)
    return (given if isinstance(given, str) else text), ids
