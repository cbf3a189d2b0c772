"""What the vision-language models (LLaVA, Qwen2-VL, Gemma 3) do alike around their own
vision towers: a step's image embeddings written over the placeholder tokens' text
embeddings, and a checkpoint split into the tower's tensors and the decoder's."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

import torch
from torch import nn

from trillm.model_executor.models.stacked_weights import MissingWeightsError, load_plain

Weights = Iterable[tuple[str, torch.Tensor]]


class ImageEmbeddingsMixin:
    """The vision-language models' shared pieces; the step's image rows are held and merged
    by ``LlamaForCausalLM`` (``set_step_embeddings`` / ``merge_step_embeddings``), which each
    model's ``embed_input_ids`` calls after its own token lookup."""

    NON_DECODER_PREFIXES: tuple[str, ...]  # the vision side's checkpoint names
    # Pipeline parallelism: the vision side (tower, projector, ...), built, loaded and run on
    # the first stage only, beside the token embeddings its rows are written over
    # (distributed/pipeline.prune_to_stage); a model without it refuses pipeline parallelism.
    FIRST_STAGE_MODULES: tuple[str, ...] = ()
    # Prompt embeddings with placeholder-driven inputs (M-RoPE, image spans): not yet.
    ACCEPTS_PROMPT_EMBEDS = False

    def first_stage_parameters(self) -> dict[str, nn.Parameter]:
        """The ``FIRST_STAGE_MODULES``' parameters by checkpoint name (none on a later
        pipeline stage, where they are ``PPMissingLayer``)."""
        own: dict[str, nn.Parameter] = {}
        for name in self.FIRST_STAGE_MODULES:
            part = getattr(self, name)
            if isinstance(part, nn.Parameter):
                own[name] = part
            else:
                own.update(part.named_parameters(prefix=name))
        return own

    def load_vision_and_text(
        self,
        load_text: Callable[[Weights], None],
        weights: Weights,
        own: dict[str, nn.Parameter],
        rename: Callable[[str], str],
        unused: tuple[str, ...] = (),
        drop_position_ids: bool = True,
    ) -> None:
        """Loads the ``NON_DECODER_PREFIXES`` tensors (renamed) into ``own`` and hands the rest
        to ``load_text``; ``unused`` prefixes are the checkpoint's parts no forward reads, and
        ``drop_position_ids`` drops the decoder's stored position ids (recomputed here)."""
        loaded: set[str] = set()

        def text_weights() -> Iterator[tuple[str, torch.Tensor]]:
            for raw, tensor in weights:
                name = rename(raw)
                if unused and name.startswith(unused):
                    continue
                if name.startswith(self.NON_DECODER_PREFIXES):
                    load_plain(own, name, tensor)
                    loaded.add(name)
                elif not (drop_position_ids and name.endswith("position_ids")):
                    yield name, tensor

        load_text(text_weights())
        missing = set(own) - loaded
        if missing:
            raise MissingWeightsError(
                f"Checkpoint is missing {len(missing)} vision weight(s), e.g. {sorted(missing)[:5]}."
            )
