"""The two sides of a KV connector (vLLM's ``KVConnectorBase_V1``, split as vLLM splits it).

The scheduler side runs in the engine core: for a waiting request it says how many prompt
tokens past the local prefix-cache hit it can load (``get_num_new_matched_tokens``), learns
the blocks the scheduler gave them (``update_state_after_alloc``), and describes each step's
loads and saves to the worker (``build_connector_meta`` -> ``KVConnectorStep``). The worker
side runs beside the paged KV cache: it loads before the step's forward (``start_load_kv``;
the whole model runs as one call, so the load completes first: vLLM's per-layer
``wait_for_layer_load`` / ``save_kv_layer`` have nothing to wait for) and saves after it
(``wait_for_save``).

``LoadsAndSaves`` and ``BlockWorker`` hold what the connectors' sides share: the scheduler
side's per-step bookkeeping, and the worker side's loop over a step's loads and saves.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Generic, Protocol, TypeVar

from trillm.messages import KVConnectorStep, KVTransferItem, SchedulerOutput

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


Lookup = TypeVar("Lookup")


class LoadsAndSaves(Generic[Lookup]):
    """The scheduler sides' shared part (``KVConnectorScheduler``): this step's lookups
    (req_id -> ``Lookup``, what the connector found) and the loads admitted since the last
    step, the loaded requests (req_id -> (tokens loaded, tokens computed before them)), those
    computed instead, and vLLM's external_prefix_cache_* counts. A connector says what a step
    saves (``_saves``)."""

    def __init__(self) -> None:
        self._lookups: dict[str, Lookup] = {}
        self._loads: list[KVTransferItem] = []  # admitted this step
        self._loaded: dict[str, tuple[int, int]] = {}
        self._not_loaded: set[str] = set()
        self._queries = 0
        self._hits = 0

    def build_connector_meta(
        self,
        out: SchedulerOutput,
        request_of: Callable[[str], Request],
        block_ids_of: Callable[[str], list[int]],
    ) -> KVConnectorStep:
        step = KVConnectorStep(loads=self._loads)
        self._loads = []
        self._lookups.clear()  # NOTE: a request not admitted is looked up again next step
        step.saves.extend(self._saves(out, request_of, block_ids_of))
        return step

    def _saves(
        self,
        out: SchedulerOutput,
        request_of: Callable[[str], Request],
        block_ids_of: Callable[[str], list[int]],
    ) -> Iterable[KVTransferItem]:
        raise NotImplementedError

    def prefix_cache_stats(self) -> tuple[int, int]:
        return self._queries, self._hits


class BlockWorker:
    """The worker sides' shared part (``KVConnectorWorker``): a step's loads one request at a
    time, a failure (``load_errors``) that request's alone, logged under the connector's
    module as "request R: <what> failed: E" and reported as "<reason>: E"; its saves in
    order."""

    load_errors: tuple[type[Exception], ...] = (OSError, ValueError, RuntimeError)
    what = "KV load"
    reason = "KV connector load"

    def start_load_kv(
        self, step: KVConnectorStep | None, kv_caches: list[torch.Tensor]
    ) -> dict[str, str]:
        failed = {}
        for item in () if step is None else step.loads:
            try:
                self._load(item, kv_caches)
            except self.load_errors as exc:  # NOTE: that request's alone
                logging.getLogger(type(self).__module__).warning(
                    "request %s: %s failed: %s", item.req_id, self.what, exc
                )
                failed[item.req_id] = f"{self.reason}: {exc}"
        return failed

    def wait_for_save(self, step: KVConnectorStep | None, kv_caches: list[torch.Tensor]) -> None:
        for item in () if step is None else step.saves:
            self._save(item, kv_caches)

    def _load(self, item: KVTransferItem, kv_caches: list[torch.Tensor]) -> None:
        raise NotImplementedError

    def _save(self, item: KVTransferItem, kv_caches: list[torch.Tensor]) -> None:
        raise NotImplementedError
