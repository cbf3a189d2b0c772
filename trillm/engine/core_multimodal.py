"""Engine core side of multimodal inputs: each request's items (processed pixel values and
their placeholder ranges), kept while the scheduler holds the request and attached to its
``NewRequestData`` whenever it is sent in full (the first time, and again after a
preemption), as ``LoRAAdmission.attach`` attaches adapters. The schedulers never see them."""

from __future__ import annotations

from collections.abc import Callable

from trillm.messages import EngineCoreRequest, MultiModalItem, NewRequestData


class CoreMultimodal:
    def __init__(self) -> None:
        self._items: dict[str, list[MultiModalItem]] = {}  # req_id -> its items

    def add(self, req: EngineCoreRequest) -> None:
        if req.mm_items:
            self._items[req.request_id] = req.mm_items

    def attach(self, new_reqs: list[NewRequestData]) -> None:
        if self._items:
            for new in new_reqs:
                new.mm_items = self._items.get(new.req_id, [])

    def release(self, is_live: Callable[[str], bool]) -> None:
        """Forgets the requests the scheduler no longer holds."""
        if self._items:
            for req_id in [r for r in self._items if not is_live(r)]:
                del self._items[req_id]
