"""The two sides of a KV connector (vLLM's ``KVConnectorBase_V1``, split as vLLM splits it).

The scheduler side runs in the engine core: for a waiting request it says how many prompt
tokens past the local prefix-cache hit it can load (``get_num_new_matched_tokens``), learns
the blocks the scheduler gave them (``update_state_after_alloc``), and describes each step's
loads and saves to the worker (``build_connector_meta`` -> ``KVConnectorStep``). The worker
side runs beside the paged KV cache: it loads before the step's forward (``start_load_kv``;
the whole model runs as one call, so the load completes first: vLLM's per-layer
``wait_for_layer_load`` / ``save_kv_layer`` have nothing to wait for) and saves after it
(``wait_for_save``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from trillm.messages import KVConnectorStep, SchedulerOutput

if TYPE_CHECKING:
    import torch

    from trillm.core.request import Request


class KVConnectorScheduler(Protocol):
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> int:
        """Prompt tokens after the first ``num_computed_tokens`` the connector can load
        (whole blocks; never the last prompt token, whose logits the step needs)."""
        ...

    def update_state_after_alloc(self, request: Request, block_ids: list[int]) -> None:
        """``request`` was admitted with these blocks (its whole table)."""
        ...

    def build_connector_meta(
        self,
        out: SchedulerOutput,
        request_of: Callable[[str], Request],
        block_ids_of: Callable[[str], list[int]],
    ) -> KVConnectorStep:
        """What the worker side loads and saves in the step ``out`` describes."""
        ...

    def load_failed(self, req_id: str) -> int:
        """The worker could not load ``req_id``'s blocks: it is not loaded again -> its tokens
        still valid (those computed before the load: its local prefix-cache hit)."""
        ...

    def request_finished(self, req_id: str) -> None: ...

    def prefix_cache_stats(self) -> tuple[int, int]:
        """(tokens queried, tokens loaded), cumulative: vLLM's external_prefix_cache_*."""
        ...


class KVConnectorWorker(Protocol):
    """``step``: the ``SchedulerOutput``'s ``kv_connector_step`` (None: nothing this step)."""

    def start_load_kv(
        self, step: KVConnectorStep | None, kv_caches: list[torch.Tensor]
    ) -> dict[str, str]:
        """Loads the step's blocks -> the requests whose load failed (req_id -> why): the
        step runs without them and the scheduler computes their tokens instead
        (``load_failed``; vLLM reports the failed blocks, ``get_block_ids_with_load_errors``)."""
        ...

    def wait_for_save(
        self, step: KVConnectorStep | None, kv_caches: list[torch.Tensor]
    ) -> None: ...


class NoConnector:
    """The worker side of an engine without ``--kv-transfer-config``."""

    def start_load_kv(
        self, step: KVConnectorStep | None, kv_caches: list[torch.Tensor]
    ) -> dict[str, str]:
        return {}

    def wait_for_save(self, step: KVConnectorStep | None, kv_caches: list[torch.Tensor]) -> None:
        pass
