"""Model building: construct the architecture on the meta device, then stream the checkpoint
(safetensors, this rank's slices and pipeline stage only; GGUF; AWQ / GPTQ) into it.

The ``ModelConfig`` it builds from comes from ``model_config.load_model_config``.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Any, cast

import torch

from trillm.config import ModelConfig
from trillm.distributed.parallel_state import get_ep_group, get_tp_group
from trillm.distributed.pipeline import first_stage_prefixes, get_pp_group, prune_to_stage
from trillm.distributed.sharding import RankShapes
from trillm.model_executor import classification, gguf_loader, transformers_numerics
from trillm.model_executor.awq_gptq import PACKED
from trillm.model_executor.layers.linear import pack_cpu_linears
from trillm.model_executor.layers.quantized_linear import load_gguf, load_group_quantized
from trillm.model_executor.model_files import ModelNotFoundError
from trillm.model_executor.quant_sharding import read_packed_shard
from trillm.model_executor.quantization import CHECKPOINT_METHODS
from trillm.model_executor.registry import CausalLM, get_model_class

_SAFETENSORS_INDEX = "model.safetensors.index.json"


def safetensors_files(folder: str | Path) -> list[Path]:
    """The shards named by model.safetensors.index.json, else every *.safetensors file."""
    folder = Path(folder)
    index = folder / _SAFETENSORS_INDEX
    if index.is_file():
        with open(index, encoding="utf-8") as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
        return [folder / name for name in names]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelNotFoundError(f"No *.safetensors weights in {str(folder)!r}.")
    return files


def iterate_weights(
    folder: str | Path,
    device: str = "cpu",
    shard: tuple[ModelConfig, RankShapes] | None = None,
    wanted: Callable[[str], bool] | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, tensor) of every checkpoint entry; with ``shard`` (tensor parallelism) only
    the rank's slice of each is read from the file (safetensors' ``get_slice``); with
    ``wanted`` (pipeline parallelism) only the entries it accepts are read at all."""
    from safetensors import safe_open

    for file in safetensors_files(folder):
        with safe_open(os.fspath(file), framework="pt", device=device) as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                if wanted is not None and not wanted(name):
                    continue
                if shard is not None and not shard[1].holds_expert(shard[0], name):
                    continue  # another rank's expert (expert parallelism)
                if shard is None:
                    yield name, f.get_tensor(name)
                elif _is_packed(shard[0], name):  # AWQ / GPTQ: whole words and groups
                    yield name, read_packed_shard(shard[0], shard[1], name, f.get_slice(name))
                else:
                    cfg, shapes = shard
                    yield name, shapes.read_shard(cfg, name, f.get_slice(name))


def _is_packed(cfg: ModelConfig, name: str) -> bool:
    return cfg.quantization in CHECKPOINT_METHODS and name.rpartition(".")[2] in PACKED


def load_weights(model: CausalLM, folder: str | Path, cfg: ModelConfig | None = None) -> None:
    """Stream every checkpoint tensor (this rank's part of it; only its pipeline stage's
    tensors) into ``model.load_weights``."""
    shard = rank_shard(cfg) if cfg is not None else None
    wanted = stage_filter(cfg) if cfg is not None else None
    model.load_weights(iterate_weights(folder, shard=shard, wanted=wanted))


def rank_shard(cfg: ModelConfig) -> tuple[ModelConfig, RankShapes] | None:
    """What ``iterate_weights`` needs to read this rank's slices (None: one rank, all)."""
    tp, ep = get_tp_group(), get_ep_group()
    if tp.world_size == 1 and ep.world_size == 1:
        return None
    shapes = RankShapes.of(cfg, tp.rank, tp.world_size, tp.expert_parallel)
    if ep is not tp:  # -dp N -ep: its block of the experts spread over every core's ranks
        shapes = dataclasses.replace(shapes, expert_ranks=(ep.rank, ep.world_size))
    return cfg, shapes


def stage_filter(cfg: ModelConfig) -> Callable[[str], bool] | None:
    """Which checkpoint names this rank's pipeline stage reads (None: all, one stage)."""
    if (pp := get_pp_group()).num_stages == 1:
        return None
    first_stage = first_stage_prefixes(get_model_class(cfg.architecture))
    return partial(pp.wants_weight, tied=cfg.tie_word_embeddings, first_stage=first_stage)


def _materialize(model: torch.nn.Module, device: str) -> None:
    """Every parameter and buffer replaced by uninitialised storage on ``device`` (what
    ``Module.to_empty`` does; the checkpoint fills them). Built here with ``torch.empty``:
    ``to_empty``'s ``empty_like`` of a meta tensor runs torch's Python reference, whose first
    call imports sympy (half a second of every worker's start). A tensor shared by two modules
    stays shared."""
    done: dict[int, torch.Tensor] = {}  # id of a meta tensor -> its replacement
    for module in model.modules():
        tables: list[tuple[dict[str, Any], bool]] = [
            (module._parameters, True),
            (module._buffers, False),
        ]
        for table, is_param in tables:
            for name, t in table.items():
                if t is None:
                    continue
                if id(t) not in done:
                    fresh = torch.empty(t.shape, dtype=t.dtype, device=device)
                    done[id(t)] = torch.nn.Parameter(fresh, t.requires_grad) if is_param else fresh
                table[name] = done[id(t)]


# vLLM's dummy weights: small uniform values (a forward stays finite), the same on every run.
DUMMY_RANGE = 1e-3
DUMMY_SEED = 1234


def dummy_weights(model: torch.nn.Module, cfg: ModelConfig) -> None:
    """``load_format='dummy'``: every parameter and buffer uniform in [-1e-3, 1e-3], seeded,
    nothing read (benchmarks at real shapes without the weights). Checkpoint-quantized models
    are refused: their packed integer words have no meaningful random value."""
    if cfg.quantization in CHECKPOINT_METHODS:
        raise ValueError(
            f"load_format='dummy' with a {cfg.quantization.upper()} checkpoint is not "
            "implemented (its packed weights and scales are read from the files)."
        )
    if classification.is_sequence_classifier(cfg.hf_config) and get_pp_group().is_last:
        classification.attach_score_head(model, len(classification.labels(cfg.hf_config)))
    generator = torch.Generator().manual_seed(DUMMY_SEED)
    for tensor in [*model.parameters(), *model.buffers()]:
        if tensor.is_floating_point():
            values = torch.rand(tensor.shape, generator=generator, dtype=torch.float32)
            tensor.data.copy_(values.mul_(2 * DUMMY_RANGE).sub_(DUMMY_RANGE))


def build_model(cfg: ModelConfig, attn_backend: Any, device: str) -> CausalLM:
    """Construct ``cfg.architecture`` without initialising it, then load the checkpoint."""
    model_class = get_model_class(cfg.architecture)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(getattr(torch, cfg.dtype))
    try:
        with torch.device("meta"):
            model = model_class(cfg, attn_backend, device=device)
            prune_to_stage(model, get_pp_group(), cfg.tie_word_embeddings)
    finally:
        torch.set_default_dtype(previous)
    _materialize(model, device)
    causal_lm = cast(CausalLM, model)
    causal_lm.tie_weights()
    if cfg.load_format == "dummy":
        dummy_weights(model, cfg)
    elif gguf_loader.find_gguf(cfg.model) is not None:
        load_gguf(model, cfg, stage_filter(cfg), rank_shard(cfg))
    elif classification.is_sequence_classifier(cfg.hf_config):
        if cfg.quantization is not None:
            raise ValueError(
                f"A quantized ({cfg.quantization}) sequence classifier is not implemented."
            )
        if get_pp_group().is_last:  # the score head stands where the LM head is
            classification.attach_score_head(model, len(classification.labels(cfg.hf_config)))
        # score.weight [num_labels, H] is read whole on every rank (no split names it)
        weights = iterate_weights(cfg.model, shard=rank_shard(cfg), wanted=stage_filter(cfg))
        causal_lm.load_weights(classification.rename_score(weights))
    elif cfg.quantization in CHECKPOINT_METHODS:
        weights = iterate_weights(cfg.model, shard=rank_shard(cfg), wanted=stage_filter(cfg))
        load_group_quantized(model, weights, cfg)
    else:
        load_weights(causal_lm, cfg.model, cfg)
    model.eval()
    if cfg.numerics == "transformers":
        transformers_numerics.prepare(model)  # and no packed linears: F.linear, as HF
    elif torch.device(device).type == "cpu":
        pack_cpu_linears(model, cfg.quantization)
    return causal_lm
