"""Stage 3 for Gemma 3 (``Gemma3ForConditionalGeneration``): the Gemma 3 image processor on its
PIL path (resized to the tower's square; pan and scan off, as by default), and each image's
placeholder ``<start_of_image>`` (what Gemma 3's chat template writes for an image part)
expanded as Gemma 3's processor expands it: ``"\\n\\n" <start_of_image> <image_soft_token> x
mm_tokens_per_image <end_of_image> "\\n\\n"``, the soft tokens being the image's feature rows.

The processor expands the text, then tokenizes: the newlines merge with the text's own around
the placeholder (``"user\\n"`` + ``"\\n\\n"`` is one token). So a prompt text gets its newlines
and ``<end_of_image>`` before it is tokenized (``prompt_text``), and stage 3 puts the soft tokens
between ``<start_of_image>`` and ``<end_of_image>``; a prompt given as token ids gets the
newlines' own tokens on both sides (``expansion``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from trillm.engine.media import MultiModalInputError
from trillm.model_executor.gemma3_mm_config import gemma3_token

if TYPE_CHECKING:
    from trillm.tokenizer_protocol import Tokenizer

_NEWLINES = "\n\n"


def is_gemma3_processor(data: dict[str, Any]) -> bool:
    return str(data.get("image_processor_type", "")).startswith("Gemma3ImageProcessor")


def load_processor(kwargs: dict[str, Any]) -> Any:
    from transformers.models.gemma3 import Gemma3ImageProcessorPil

    if kwargs.get("do_pan_and_scan"):
        raise ValueError(
            "The model folder's image processor sets do_pan_and_scan (Gemma 3's pan and scan "
            "crops), which is not supported yet."
        )
    return Gemma3ImageProcessorPil(**kwargs)


def check_kwargs(kwargs: dict[str, Any], param: str) -> None:
    """Pan and scan makes crops that the prompt would have to name in text; refused."""
    if kwargs.get("do_pan_and_scan"):
        raise MultiModalInputError(
            f"{param}: do_pan_and_scan (Gemma 3's pan and scan crops) is not supported yet.",
            param,
        )


def expansion(mm_config: dict[str, Any], tokenizer: Tokenizer) -> tuple[int, list[int], list[int]]:
    """(the placeholder's id, the ids before an image's soft tokens, the ids after them), for
    a prompt given as token ids."""
    boi = gemma3_token(mm_config, "boi_token_index")
    eoi = gemma3_token(mm_config, "eoi_token_index")
    newlines = list(tokenizer.encode(_NEWLINES, add_special_tokens=False))
    return boi, [*newlines, boi], [eoi, *newlines]


def prompt_text(text: str, boi: str, eoi: str) -> str:
    """The prompt text with each image's newlines and end token, as the processor writes
    them: stage 3 then finds ``boi`` followed by ``eoi`` (``is_expanded``)."""
    return text.replace(boi, f"{_NEWLINES}{boi}{eoi}{_NEWLINES}")


def is_expanded(ids: list[int], slot: int, eoi: int) -> bool:
    """The placeholder at ``slot`` came from ``prompt_text`` (its end token follows it)."""
    return slot + 1 < len(ids) and ids[slot + 1] == eoi
