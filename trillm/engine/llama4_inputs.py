"""Stage 3 for Llama 4 (``Llama4ForConditionalGeneration``): its image processor's tiling and
its placeholder expansion, as transformers' ``Llama4ImageProcessor`` and ``Llama4Processor``
compute them.

transformers' image processor needs torchvision, which cannot load beside the CPU torch build
here; the same operations run on torch alone: the image (uint8) resized without distortion by
torchvision's own call (bilinear, antialiased, on uint8), padded right and below to the best
canvas of up to ``max_patches`` tiles, rescaled and normalized in bfloat16 (as the processor
does), split into tiles row by row, and a global tile (the whole image resized to one tile)
appended when there are several (equal to transformers' values, bfloat16 rounding included,
where torchvision loads). An item's data is its tiles flattened, then its (rows, columns) of
tiles and the ids of ``<|image|>`` and the separators (``models/llama4.py`` reads them).

An image's ``<|image|>`` (what the chat template writes) becomes ``<|image_start|>``, per tile
row its tiles' ``<|patch|>`` tokens joined by ``<|tile_x_separator|>`` and ended by
``<|tile_y_separator|>`` (tiled images only), then ``<|image|>``, the global tile's patches and
``<|image_end|>``. The item's placeholder span is everything between start and end: the model
writes the tiles' features over the patches and the separators' own token embeddings over
theirs.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypedDict

import numpy as np

from trillm.engine.media import MultiModalInputError
from trillm.model_executor.llama4_vision_config import ARCHITECTURE, patches_per_tile, tile_size

if TYPE_CHECKING:
    import torch

    from trillm.tokenizer_protocol import Tokenizer

START, END, IMAGE = "<|image_start|>", "<|image_end|>", "<|image|>"
PATCH, TILE_X, TILE_Y = "<|patch|>", "<|tile_x_separator|>", "<|tile_y_separator|>"
_BILINEAR = 2  # PILImageResampling.BILINEAR, the processor's default and the one implemented
_NOT_KWARGS = ("image_processor_type", "processor_class", "_processor_class")
_INERT = ("do_convert_rgb",)  # images are converted to RGB before processing in any case


class Llama4ImageKwargs(TypedDict, total=False):
    """The processor's keywords a request may set (``mm_processor_kwargs``)."""

    max_patches: int
    resize_to_max_canvas: bool
    do_rescale: bool
    rescale_factor: float
    do_normalize: bool
    image_mean: list[float]
    image_std: list[float]


@dataclass(frozen=True)
class Llama4ImageProcessing:
    tile: int
    max_patches: int = 16
    resize_to_max_canvas: bool = False
    do_rescale: bool = True
    rescale_factor: float = 1 / 255
    do_normalize: bool = True
    image_mean: tuple[float, ...] = (0.5, 0.5, 0.5)
    image_std: tuple[float, ...] = (0.5, 0.5, 0.5)

    valid_kwargs = Llama4ImageKwargs

    def __call__(self, images: Any, return_tensors: str = "np", **kwargs: Any) -> dict[str, Any]:
        """One RGB PIL image -> {"pixel_values": [tiles, 3, S, S], "aspect_ratio": (h, w)}."""
        changes: dict[str, Any] = {
            k: tuple(v) if isinstance(v, list) else v for k, v in kwargs.items()
        }
        settings = replace(self, **changes)
        return settings.tiles(np.array(images))  # a copy: torch writes into it

    def tiles(self, rgb: np.ndarray) -> dict[str, Any]:  # rgb [H, W, 3] uint8
        import torch

        if not 1 <= int(self.max_patches) <= 64:
            raise ValueError(f"max_patches must be in [1, 64], got {self.max_patches!r}.")
        image = torch.from_numpy(rgb).permute(2, 0, 1)[None]  # [1, 3, H, W]
        size = (image.shape[-2], image.shape[-1])
        canvas = best_canvas(
            size, self.tile, int(self.max_patches), bool(self.resize_to_max_canvas)
        )
        bound = canvas if self.resize_to_max_canvas else (
            min(max(size[0], self.tile), canvas[0]), min(max(size[1], self.tile), canvas[1])
        )  # fmt: skip
        resized = _resize(image, _without_distortion(size, bound))
        padded = torch.nn.functional.pad(
            resized, (0, canvas[1] - resized.shape[-1], 0, canvas[0] - resized.shape[-2])
        )
        rows, cols = canvas[0] // self.tile, canvas[1] // self.tile
        tiles = self._normalized(padded)[0]  # [3, rows * S, cols * S]
        tiles = tiles.reshape(3, rows, self.tile, cols, self.tile).permute(1, 3, 0, 2, 4)
        tiles = tiles.reshape(rows * cols, 3, self.tile, self.tile)
        if rows * cols > 1:  # the global tile: the whole image at one tile's size
            whole = self._normalized(_resize(image, (self.tile, self.tile)))
            tiles = torch.cat([tiles, whole])
        return {"pixel_values": tiles.float().numpy(), "aspect_ratio": (rows, cols)}

    def _normalized(self, image: torch.Tensor) -> torch.Tensor:
        """The processor's bfloat16 rescale and normalization (its override of the fused
        float32 one), so the values are the ones transformers hands its model."""
        import torch

        if self.do_rescale and self.do_normalize:
            image = image.to(torch.bfloat16) * self.rescale_factor
        elif self.do_rescale:
            return image * self.rescale_factor
        if not self.do_normalize:
            return image.float()
        mean = torch.tensor(self.image_mean, dtype=image.dtype)[:, None, None]
        std = torch.tensor(self.image_std, dtype=image.dtype)[:, None, None]
        return (image - mean) / std


def _resize(image: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    """torchvision's bilinear antialiased resize of a uint8 image (its CPU path: torch's
    native uint8 interpolation, nothing done at the same size)."""
    import torch

    if (image.shape[-2], image.shape[-1]) == size:
        return image
    return torch.nn.functional.interpolate(
        image, size=list(size), mode="bilinear", align_corners=False, antialias=True
    )


def supported_canvases(max_tiles: int, tile: int) -> list[tuple[int, int]]:
    """Every (height, width) of up to ``max_tiles`` tiles, in the processor's order (ties
    between canvases go to the first)."""
    by_ratio: dict[float, list[tuple[int, int]]] = {}
    for count in range(max_tiles, 0, -1):
        for rows in sorted(f for f in range(1, count + 1) if count % f == 0):
            by_ratio.setdefault(rows / (count // rows), []).append((rows, count // rows))
    return [(r * tile, c * tile) for group in by_ratio.values() for r, c in group]


def best_canvas(size: tuple[int, int], tile: int, max_tiles: int, to_max: bool) -> tuple[int, int]:
    """The processor's ``get_best_fit``: the canvas needing the least upscaling (or the most,
    ``to_max``), else the least downscaling; the smallest area among equals."""
    import torch

    canvases = torch.tensor(supported_canvases(max_tiles, tile))
    scale_h, scale_w = canvases[:, 0] / size[0], canvases[:, 1] / size[1]
    scales = torch.where(scale_h > scale_w, scale_w, scale_h)
    up = scales[scales >= 1]
    if len(up):
        chosen = torch.max(up) if to_max else torch.min(up)
    else:
        chosen = torch.max(scales[scales < 1])
    fits = canvases[scales == chosen]
    best = fits[torch.argmin(fits[:, 0] * fits[:, 1])]
    return int(best[0]), int(best[1])


def _without_distortion(size: tuple[int, int], target: tuple[int, int]) -> tuple[int, int]:
    """The largest (height, width) within ``target`` of ``size``'s aspect ratio."""
    height, width = size
    scale_w, scale_h = target[1] / width, target[0] / height
    if scale_w < scale_h:
        return max(min(int(np.floor(height * scale_w)), target[0]), 1), max(target[1], 1)
    return max(target[0], 1), max(min(int(np.floor(width * scale_h)), target[1]), 1)


def is_llama4_processor(data: dict[str, Any]) -> bool:
    kind = str(data.get("image_processor_type") or data.get("processor_class") or "")
    return kind.startswith(("Llama4ImageProcessor", "Llama4Processor"))


def load_processor(folder: str, mm_config: dict[str, Any]) -> Llama4ImageProcessing:
    """The folder's image processor, its tile the vision tower's and its processor's patch
    counting the tower's."""
    check_patch_size(folder, mm_config)
    processor = processing(folder)
    tile = tile_size(mm_config)
    if processor.tile != tile:
        raise ValueError(
            f"{ARCHITECTURE}: the image processor's size {processor.tile} is not the vision "
            f"tower's {tile}x{tile}."
        )
    return processor


def processing(folder: str) -> Llama4ImageProcessing:
    """The folder's image processor config, read; what the processing here does not do
    refused by name."""
    data = _processor_data(Path(folder))
    kwargs = {k: v for k, v in data.items() if k not in _NOT_KWARGS and k not in _INERT}
    size = kwargs.pop("size", {"height": 336, "width": 336})
    if size.get("height") != size.get("width") or not isinstance(size.get("height"), int):
        raise ValueError(f"{ARCHITECTURE}: the image processor's size {size} is not square.")
    if not kwargs.pop("do_resize", True):
        raise ValueError(f"{ARCHITECTURE}: the image processor's do_resize=false is not supported.")
    resample = kwargs.pop("resample", _BILINEAR)
    if resample != _BILINEAR:
        raise ValueError(
            f"{ARCHITECTURE}: the image processor's resample {resample!r} is not supported; "
            "supported: 2 (bilinear)."
        )
    unknown = sorted(set(kwargs) - set(Llama4ImageKwargs.__annotations__))
    if unknown:
        raise ValueError(
            f"{ARCHITECTURE}: the image processor's {', '.join(unknown)} not supported."
        )
    lists = {k: tuple(v) for k, v in kwargs.items() if isinstance(v, list)}
    return Llama4ImageProcessing(int(size["height"]), **{**kwargs, **lists})


def _processor_data(folder: Path) -> dict[str, Any]:
    nested = folder / "processor_config.json"
    fields = json.loads(nested.read_text(encoding="utf-8")) if nested.is_file() else {}
    _check_processor_fields(fields)
    if "image_processor" in fields:
        return dict(fields["image_processor"])
    path = folder / "preprocessor_config.json"
    if not path.is_file():
        raise ValueError(f"The model folder {str(folder)!r} has no image processor config.")
    return dict(json.loads(path.read_text(encoding="utf-8")))


def _check_processor_fields(fields: dict[str, Any]) -> None:
    """The processor's own tokens are the ones expanded here."""
    expected = {"fake_image_token": IMAGE, "image_token": IMAGE, "patch_token": PATCH}
    for key, value in expected.items():
        if fields.get(key, value) != value:
            raise ValueError(
                f"{ARCHITECTURE}: processor_config.json's {key} {fields[key]!r} is not "
                f"supported; supported: {value!r}."
            )


def check_patch_size(folder: str, mm_config: dict[str, Any]) -> None:
    """processor_config.json's patch_size / pixel_shuffle_ratio count the patches per tile as
    the vision tower makes them."""
    path = Path(folder) / "processor_config.json"
    fields = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    vc = mm_config["vision_config"]
    for key, value in (("patch_size", 14), ("pixel_shuffle_ratio", 0.5)):
        if fields.get(key, value) != vc.get(key, value):
            raise ValueError(
                f"{ARCHITECTURE}: processor_config.json's {key} {fields.get(key, value)!r} is "
                f"not the vision tower's {vc.get(key, value)!r}; the placeholders would not "
                "match the features."
            )


def aspect_ratio(values: np.ndarray) -> tuple[int, int]:
    """An item's (rows, columns) of tiles (``Llama4Expansion.item_values``)."""
    return int(values[-5]), int(values[-4])


class Llama4Expansion:
    """The ids around and between an image's tiles (the tokenizer's special tokens)."""

    def __init__(self, mm_config: dict[str, Any], tokenizer: Tokenizer) -> None:
        vocab = tokenizer.get_vocab()
        names = (START, END, IMAGE, PATCH, TILE_X, TILE_Y)
        missing = [name for name in names if name not in vocab]
        if missing:
            raise ValueError(f"{ARCHITECTURE}: the tokenizer lacks {', '.join(missing)}.")
        ids = [vocab[name] for name in names]
        if int(mm_config.get("image_token_index", 200092)) != ids[3]:
            raise ValueError(
                f"{ARCHITECTURE}: config.json's image_token_index is not the tokenizer's {PATCH}."
            )
        self.start, self.end, self.image, self.patch, self.tile_x, self.tile_y = ids
        self.per_tile = patches_per_tile(mm_config)

    @property
    def slots(self) -> tuple[int, list[int], list[int]]:
        """(the prompt's placeholder, the ids before an image's span, the ids after it)."""
        return self.image, [self.start], [self.end]

    def item_values(self, processed: dict[str, Any]) -> np.ndarray:  # [tiles * 3 * S * S + 5]
        """One image's tiles flattened, then its (rows, columns) of tiles and the ids of
        ``<|image|>`` and the separators, whose embeddings the model writes over theirs."""
        tiles = np.asarray(processed["pixel_values"], dtype=np.float32).reshape(-1)
        rows, cols = processed["aspect_ratio"]
        trailer = np.asarray([rows, cols, self.image, self.tile_x, self.tile_y], np.float32)
        return np.concatenate([tiles, trailer])

    def span(self, values: np.ndarray) -> list[int]:
        """The ids between ``<|image_start|>`` and ``<|image_end|>`` of an item."""
        rows, cols = aspect_ratio(values)
        tile = [self.patch] * self.per_tile
        out: list[int] = []
        if rows * cols > 1:
            for _ in range(rows):
                for x in range(cols):
                    out += tile + ([self.tile_x] if x < cols - 1 else [])
                out.append(self.tile_y)
        return out + [self.image] + tile


def check_kwargs(kwargs: dict[str, Any], param: str) -> None:
    patches = kwargs.get("max_patches")
    if patches is not None and not (isinstance(patches, int) and 1 <= patches <= 64):
        raise MultiModalInputError(
            f"{param}['max_patches'] must be a whole number in [1, 64], got {patches!r}.", param
        )
