"""Sequence classification models (vLLM's ``--convert classify`` / ``*ForSequenceClassification``
checkpoints): a decoder whose last token's final hidden state goes through a ``score`` head
[num_labels, H] instead of the LM head; the class probabilities are the softmax of those logits
(a sigmoid for a single label), as vLLM's classify pooler gives them.

The decoder is the architecture's ``*ForCausalLM`` class; its ``lm_head`` is replaced by the
score head before loading (``score.weight`` loads into it), so nothing else changes in the
model code. The LM head never runs in a pooling runner; the pooling runner applies this head
to the pooled (LAST) row (``model_executor/pooling.finish_classification``).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the frontend reads the config's names here without torch
    import torch
    from torch import nn

SUFFIX = "ForSequenceClassification"


def is_sequence_classifier(hf_config: dict[str, Any]) -> bool:
    architectures = hf_config.get("architectures") or []
    return bool(architectures) and str(architectures[0]).endswith(SUFFIX)


def causal_architecture(architecture: str) -> str:
    """``Qwen2ForSequenceClassification`` -> ``Qwen2ForCausalLM`` (the decoder class); an
    encoder's cross-encoder keeps its name (``models/bert.py`` computes its head)."""
    from trillm.model_executor.encoder_config import is_encoder

    if is_encoder(architecture):
        return architecture
    return architecture.removesuffix(SUFFIX) + "ForCausalLM"


def labels(hf_config: dict[str, Any]) -> list[str]:
    """The class names in index order: ``id2label``, else ``LABEL_i`` for ``num_labels``."""
    id2label = hf_config.get("id2label") or {}
    num = int(hf_config.get("num_labels") or len(id2label) or 2)
    return [str(id2label.get(str(i), id2label.get(i, f"LABEL_{i}"))) for i in range(num)]


def attach_score_head(model: nn.Module, num_labels: int) -> None:
    """Replace the model's LM head by the score head [num_labels, H] (same device and dtype)."""
    from torch import nn

    head = model.get_submodule("lm_head")
    assert isinstance(head, nn.Linear)
    weight = head.weight
    score = nn.Linear(
        head.in_features, num_labels, bias=False, device=weight.device, dtype=weight.dtype
    )
    model.lm_head = score  # type: ignore[assignment]


def rename_score(weights: Iterator[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's ``score.weight`` under the model's ``lm_head.weight``."""
    for name, tensor in weights:
        yield ("lm_head.weight" if name == "score.weight" else name), tensor


def class_probs(logits: torch.Tensor) -> torch.Tensor:  # [num_labels] -> [num_labels] fp32
    import torch

    logits = logits.float()
    if logits.numel() == 1:
        return torch.sigmoid(logits)
    return torch.softmax(logits, dim=-1)
