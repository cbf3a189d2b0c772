"""Pipeline parallelism: the layers split into contiguous stages, one stage per group of ranks.

With ``pipeline_parallel_size`` M and ``tensor_parallel_size`` N there are M * N worker ranks;
global rank ``g`` is tensor-parallel rank ``g % N`` of stage ``g // N`` (vLLM's layout). Stage
``s`` holds layers ``[s * L // M, (s + 1) * L // M)`` (an even split), stage 0 the embedding,
the last stage the final norm and the LM head (and the embedding too when the head is tied to
it). Each rank builds, loads and caches only its stage's layers.

Every rank reads each step from the ring and prepares the same inputs; stage 0 embeds and runs
its layers, then sends the hidden states (and the Llama decoders' residual stream), ``[T, H]``
each, to the same tensor-parallel rank of the next stage (``torch.distributed`` point-to-point
``send`` / ``recv``: gloo on CPU, NCCL on GPU); the last stage computes the logits and samples.
The other stages get its tokens with a later step (``trillm/worker/pipeline_tokens.py``), so
no stage waits for a later one: with the engine core's batch queue, stage 0 runs step i + 1
while stage 1 runs step i (one micro-batch per stage in flight).

A ``send``/``recv`` that fails (a peer rank died) or does not complete within the
group's timeout raises ``CollectiveTimeoutError``, which the worker treats as fatal.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from trillm.distributed.parallel_state import unsharded
from trillm.errors import CollectiveTimeoutError

# Checkpoint names outside the decoder layers, by who needs them (raw names; GPT-NeoX's and
# the vision-language models' language model's too). A vision-language model's vision side is
# read by the first stage only: its ``FIRST_STAGE_MODULES`` (``first_stage_prefixes``).
_EMBEDDING = (
    "model.embed_tokens.",
    "gpt_neox.embed_in.",
    "language_model.model.embed_tokens.",
    "model.language_model.embed_tokens.",
    "backbone.embeddings.",  # Nemotron-H's
)
_HEAD = (
    "lm_head.",
    "embed_out.",
    "model.norm.",
    "gpt_neox.final_layer_norm.",
    "language_model.lm_head.",
    "language_model.model.norm.",
    "model.language_model.norm.",
    "backbone.norm_f.",  # Nemotron-H's
)
_LAYER = re.compile(r"\.layers\.(\d+)\.")


def stage_layers(num_layers: int, num_stages: int, stage: int) -> tuple[int, int]:
    """[start, end) of the layers stage ``stage`` runs (an even, contiguous split)."""
    return stage * num_layers // num_stages, (stage + 1) * num_layers // num_stages


class PPMissingLayer(nn.Module):
    """Stands where a module of another stage would be (keeps the layer indices and names)."""

    def forward(self, *args: object, **kwargs: object) -> None:
        raise RuntimeError("A module of another pipeline stage was called.")


@dataclass
class IntermediateTensors:
    """What one stage hands the next: the hidden states and, for decoders that fold the
    residual adds into their norms (Llama), the residual stream."""

    hidden: torch.Tensor  # [T, H]
    residual: torch.Tensor | None = None  # [T, H]

    def tensors(self) -> list[torch.Tensor]:
        return [self.hidden] if self.residual is None else [self.hidden, self.residual]


@dataclass
class PipelineGroup:
    stage: int = 0
    num_stages: int = 1
    tp_rank: int = 0
    tp_size: int = 1
    start_layer: int = 0
    end_layer: int = -1  # -1: every layer (one stage)
    timeout_s: float = 0.0
    comm_time_s: float = field(default=0.0, repr=False)

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.num_stages - 1

    @property
    def rank(self) -> int:  # global rank
        return self.stage * self.tp_size + self.tp_rank

    def owns_layer(self, index: int) -> bool:
        return self.end_layer < 0 or self.start_layer <= index < self.end_layer

    def wants_weight(self, name: str, tied: bool, first_stage: tuple[str, ...] = ()) -> bool:
        """Whether this stage loads checkpoint tensor ``name`` (read before any byte is);
        ``first_stage``: the first stage's own modules' names (``first_stage_prefixes``), each
        a tensor's whole name or the start of its dotted path."""
        if self.num_stages == 1:
            return True
        if any(name == n or name.startswith(n + ".") for n in first_stage):
            return self.is_first  # before _LAYER: a vision tower has layers too
        if m := _LAYER.search(name):
            return self.owns_layer(int(m.group(1)))
        if name.startswith(_EMBEDDING):
            return self.is_first or (tied and self.is_last)
        if name.startswith(_HEAD):
            return self.is_last
        return True

    def send(self, tensors: list[torch.Tensor]) -> None:
        """To the same tensor-parallel rank of the next stage."""
        dst = self.rank + self.tp_size
        for t in tensors:
            self._run("send", dist.send, t.contiguous(), dst)

    def recv(
        self, count: int, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
    ) -> list[torch.Tensor]:
        """``count`` tensors of ``shape`` from the same tensor-parallel rank of the stage
        before."""
        src = self.rank - self.tp_size
        out = []
        for _ in range(count):
            t = torch.empty(shape, dtype=dtype, device=device)
            self._run("recv", dist.recv, t, src)
            out.append(t)
        return out

    def _run(self, op: str, fn: Callable[..., object], t: torch.Tensor, peer: int) -> None:
        start = time.perf_counter()
        try:
            fn(t, peer)
        except RuntimeError as exc:  # gloo / NCCL report a timeout or a lost peer this way
            raise CollectiveTimeoutError(
                f"Pipeline-parallel rank {self.rank} (stage {self.stage}): {op} with rank "
                f"{peer} failed (a peer rank stopped answering within {self.timeout_s:g} s "
                f"or died): {exc}",
                rank=self.rank,
                op=op,
            ) from exc
        if t.is_cuda:
            torch.cuda.synchronize()
        self.comm_time_s += time.perf_counter() - start


_group = PipelineGroup()


def get_pp_group() -> PipelineGroup:
    return _group


def set_pp_group(group: PipelineGroup) -> None:
    global _group
    _group = group


@contextmanager
def whole_model() -> Iterator[None]:
    """Models built (and loaded) inside see one stage of one rank: every layer, their own
    head, no tensor-parallel split. The draft model runs whole on the output rank (the last
    stage's first tensor-parallel rank), beside that rank's shard of the target."""
    saved = _group
    set_pp_group(PipelineGroup())
    try:
        with unsharded():
            yield
    finally:
        set_pp_group(saved)


def first_stage_prefixes(model_class: type) -> tuple[str, ...]:
    """The checkpoint names of a model's ``FIRST_STAGE_MODULES`` (its vision side: modules or
    parameters such as LLaVA-OneVision's ``image_newline``), in either transformers layout
    (``vision_tower.*`` or ``model.vision_tower.*``)."""
    names = getattr(model_class, "FIRST_STAGE_MODULES", ())
    return tuple(prefix + name for name in names for prefix in ("", "model."))


def prune_to_stage(model: nn.Module, pp: PipelineGroup, tied: bool) -> None:
    """Replace the modules of other stages (built on the meta device) by ``PPMissingLayer``,
    before any memory is allocated for them: ``model.model.layers[i]`` outside the stage, the
    embedding off stage 0 (kept on the last stage when the head is tied to it), the final norm
    and the head off the last stage, a vision-language model's ``FIRST_STAGE_MODULES`` (its
    tower: images are encoded and merged into the embeddings on stage 0) off the others."""
    if pp.num_stages == 1:
        return
    stack = model.model
    assert isinstance(stack, nn.Module)
    layers = stack.layers
    assert isinstance(layers, nn.ModuleList)
    for i in range(len(layers)):
        if not pp.owns_layer(i):
            layers[i] = PPMissingLayer()
    if not (pp.is_first or (tied and pp.is_last)):
        stack.embed_tokens = PPMissingLayer()
    if not pp.is_first:
        for name in getattr(model, "FIRST_STAGE_MODULES", ()):
            if isinstance(getattr(model, name), nn.Parameter):
                delattr(model, name)  # a parameter's slot takes no module
            setattr(model, name, PPMissingLayer())
    if not pp.is_last:
        stack.norm = PPMissingLayer()
        model.lm_head = PPMissingLayer()


def is_missing(model: nn.Module, name: str) -> bool:
    """Whether parameter ``name`` belongs to a module of another stage."""
    module: nn.Module | None = model
    for part in name.split(".")[:-1]:
        if isinstance(module, PPMissingLayer):
            return True
        module = getattr(module, part, None)
        if not isinstance(module, nn.Module):
            return False
    return isinstance(module, PPMissingLayer)
