"""The folder's image processor as the models without their own stage-3 module load it
(transformers' PIL paths: no torchvision), and the check of ``mm_processor_kwargs`` against the
keywords it takes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from trillm.engine import gemma3_inputs as gemma3
from trillm.engine import llama4_inputs as llama4
from trillm.engine import qwen2_vl_inputs as qwen2_vl
from trillm.engine.media import MultiModalInputError

_PROCESSOR_FILES = ("processor_config.json", "preprocessor_config.json")
_NOT_KWARGS = ("image_processor_type", "processor_class", "_processor_class")
# The image processor's keywords that are not the caller's to set (mm_processor_kwargs).
_RESERVED_KWARGS = ("return_tensors", "device", "data_format", "input_data_format")


def load_image_processor(folder: str) -> Any:
    """The folder's CLIP (or Qwen2-VL) image processor, on its PIL path."""
    from transformers.models.clip import CLIPImageProcessorPil

    for name in _PROCESSOR_FILES:
        path = Path(folder) / name
        if path.is_file():
            data = json.loads(path.read_text(encoding="utf-8"))
            data = data.get("image_processor", data)
            kwargs = {k: v for k, v in data.items() if k not in _NOT_KWARGS}
            if qwen2_vl.is_qwen2_vl_processor(data):
                return qwen2_vl.load_processor(kwargs)
            if gemma3.is_gemma3_processor(data):
                return gemma3.load_processor(kwargs)
            if llama4.is_llama4_processor(data):
                return llama4.processing(folder)
            return CLIPImageProcessorPil(**kwargs)
    raise ValueError(f"The model folder {folder!r} has no image processor config.")


def check_keywords(processor: Any, kwargs: dict[str, Any], param: str) -> None:
    """Each key of ``kwargs`` one the image processor takes; else an error naming them."""
    valid = set(processor.valid_kwargs.__annotations__) - set(_RESERVED_KWARGS)
    unknown = sorted(k for k in kwargs if k not in valid)
    if unknown:
        raise MultiModalInputError(
            f"{param}: {', '.join(map(repr, unknown))} not taken by this model's image "
            f"processor ({type(processor).__name__}); it takes {', '.join(sorted(valid))}.",
            param,
        )
