"""The worker's resident LoRA adapters and each step's row grouping.

At most ``max_loras`` adapters are resident, each in a slot 0 .. max_loras - 1 of every LoRA
linear's stacked weights; loading one more evicts the least recently used adapter that no
request in the batch holds, and takes its slot. Up to ``max_cpu_loras`` adapters (vLLM's
``--max-cpu-loras``, at least ``max_loras``) stay read in CPU memory, least recently used
dropped first: one evicted from its slot and asked for again is not read from disk again. The engine core admits at most ``max_loras``
adapters among its running requests, so a batch always fits.

With tensor parallelism each rank loads its part of every adapter, split like the base
layer it rides on (``LoRAManager._rank_part``).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import torch

from trillm.config import ModelConfig
from trillm.distributed.parallel_state import get_tp_group
from trillm.distributed.sharding import RankShapes
from trillm.lora.layers import TARGET_MODULES, LoRALinear, StepSlots, attach_lora
from trillm.lora.peft import AdapterWeights, load_adapter
from trillm.lora.request import LoRARequest

logger = logging.getLogger(__name__)


class TooManyLoRAsError(RuntimeError):
    """Every resident adapter is in use and one more is asked for."""


class LoRAManager:
    def __init__(
        self,
        model: object,  # the runner's CausalLM (an nn.Module)
        model_cfg: ModelConfig,
        max_loras: int,
        max_lora_rank: int,
        device: torch.device,
        dtype: torch.dtype,
        max_cpu_loras: int | None = None,  # None: max_loras
    ) -> None:
        self.model_cfg = model_cfg
        self.max_loras = max_loras
        self.max_cpu_loras = max(max_cpu_loras or max_loras, max_loras)
        # (adapter id, path) -> its weights as read, LRU first
        self._cpu: OrderedDict[tuple[int, str], AdapterWeights] = OrderedDict()
        self.max_lora_rank = max_lora_rank
        self.device, self.dtype = device, dtype
        self.step_slots = StepSlots(torch.zeros(max_loras, dtype=torch.float32, device=device))
        self.linears: dict[tuple[int, str], LoRALinear] = attach_lora(
            model, self.step_slots, max_lora_rank
        )
        tp = get_tp_group()  # tensor parallelism: each rank holds its part of every adapter
        self.shapes = (
            None
            if tp.world_size == 1
            else RankShapes.of(model_cfg, tp.rank, tp.world_size, tp.expert_parallel)
        )
        self.resident: OrderedDict[int, LoRARequest] = OrderedDict()  # LRU first
        self._slot: dict[int, int] = {}  # resident adapter id -> its slot
        self._refs: dict[int, int] = {}  # adapter id -> requests holding it
        self._req_adapter: dict[str, int] = {}  # req_id -> adapter id

    # ------------------------------------------------------------ requests
    def add_request(self, req_id: str, lora: LoRARequest) -> None:
        """The request's adapter made resident (loaded now if it is not); raises on a bad
        adapter or when all ``max_loras`` resident adapters are in use."""
        self._ensure_resident(lora)
        self._req_adapter[req_id] = lora.lora_int_id
        self._refs[lora.lora_int_id] = self._refs.get(lora.lora_int_id, 0) + 1

    def remove_request(self, req_id: str) -> None:
        adapter_id = self._req_adapter.pop(req_id, None)
        if adapter_id is not None:
            self._refs[adapter_id] -= 1

    def _ensure_resident(self, lora: LoRARequest) -> None:
        if lora.lora_int_id in self.resident:
            self.resident.move_to_end(lora.lora_int_id)
            return
        if len(self.resident) >= self.max_loras:
            victim = next((i for i in self.resident if not self._refs.get(i)), None)
            if victim is None:
                raise TooManyLoRAsError(
                    f"all {self.max_loras} resident LoRA adapters (max_loras) are in use."
                )
            self._evict(victim)
        weights = self._read(lora)
        per_module: dict[tuple[int, str], list[tuple[str | None, torch.Tensor, torch.Tensor]]] = {}
        for (layer, proj), (a, b) in weights.modules.items():
            path, shard = TARGET_MODULES[proj]
            a, b = self._rank_part(layer, proj, a, b)
            per_module.setdefault((layer, path), []).append((shard, a, b))
        slot = min(set(range(self.max_loras)) - set(self._slot.values()))
        for key, parts in per_module.items():
            if key in self.linears:  # NOTE: not there: a layer of another pipeline stage
                self.linears[key].set_adapter(slot, self.max_loras, parts, self.dtype, self.device)
        self.step_slots.scales[slot] = weights.config.scale
        self._slot[lora.lora_int_id] = slot
        self.resident[lora.lora_int_id] = lora
        logger.info(
            "LoRA adapter %s (id %d) loaded from %s",
            lora.lora_name,
            lora.lora_int_id,
            lora.lora_path,
        )

    def _read(self, lora: LoRARequest) -> AdapterWeights:
        """The adapter's weights: from the CPU cache, else from its files (then cached)."""
        key = (lora.lora_int_id, lora.lora_path)
        weights = self._cpu.pop(key, None)
        if weights is None:
            weights = load_adapter(lora.lora_path, self.model_cfg, self.max_lora_rank)
        self._cpu[key] = weights  # the most recently used
        while len(self._cpu) > self.max_cpu_loras:
            self._cpu.popitem(last=False)
        return weights

    def _rank_part(
        self, layer: int, proj: str, a: torch.Tensor, b: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """This tensor-parallel rank's part of one module's A [r, in] / B [out, r], split as
        the base weight W = B A is (``RankShapes.split_of``): a column-parallel layer's rows
        of W are B's rows (A whole); a row-parallel layer's columns of W are A's columns (B
        whole), and the ranks' partial deltas x_r A_r^T B^T add up to x A^T B^T in the
        all-reduce that follows the base layer (the delta is added to its partial output)."""
        if self.shapes is None:
            return a, b
        split = self.shapes.split_of(self.model_cfg, f"model.layers.{layer}.x.{proj}.weight")
        if split is None:  # NOTE: every LoRA target is split (sharding.RankShapes)
            return a, b
        dim, start, length = split
        if dim == 0:
            return a, b[start : start + length].contiguous()
        return a[:, start : start + length].contiguous(), b

    def _evict(self, adapter_id: int) -> None:
        slot = self._slot.pop(adapter_id)
        for linear in self.linears.values():
            linear.clear(slot)
        self.resident.pop(adapter_id)
        self._refs.pop(adapter_id, None)

    # ------------------------------------------------------------ steps
    @contextmanager
    def step(self, req_ids: list[str], query_start_loc: np.ndarray) -> Iterator[None]:
        """During the forward: each token's adapter slot, -1 for base-model requests (request
        i's rows are ``query_start_loc[i]:query_start_loc[i + 1]``)."""
        slots = np.full(int(query_start_loc[len(req_ids)]), -1, dtype=np.int64)  # [T]
        used: set[int] = set()
        for i, req_id in enumerate(req_ids):
            adapter_id = self._req_adapter.get(req_id)
            if adapter_id is not None:
                slot = self._slot[adapter_id]
                slots[int(query_start_loc[i]) : int(query_start_loc[i + 1])] = slot
                used.add(slot)
        if used:
            self.step_slots.slots = torch.from_numpy(slots).to(self.device)
            self.step_slots.used = frozenset(used)
        try:
            yield
        finally:
            self.step_slots.slots = None
            self.step_slots.used = frozenset()
