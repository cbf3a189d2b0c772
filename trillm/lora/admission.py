"""Engine core side of LoRA: at most ``max_loras`` adapters among the scheduler's requests.

A request whose adapter would be one too many waits here (in arrival order) until a running
adapter's last request ends; requests of admitted adapters and base-model requests pass at
once. So a batch never needs more adapters than a worker keeps resident. The adapter of each
admitted request is remembered here and attached to its ``NewRequestData`` when scheduled.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Callable

from trillm.lora.request import LoRARequest
from trillm.messages import EngineCoreRequest, NewRequestData


class LoRAAdmission:
    def __init__(self, max_loras: int) -> None:
        self.max_loras = max_loras
        self.held: deque[EngineCoreRequest] = deque()
        self._live: dict[str, LoRARequest] = {}  # admitted req_id -> its adapter
        self._counts: Counter[int] = Counter()  # adapter id -> admitted requests

    @property
    def has_held(self) -> bool:
        return bool(self.held)

    def offer(self, req: EngineCoreRequest) -> bool:
        """True: the request may enter the scheduler now; False: it is held."""
        lora = req.lora_request
        if lora is None:
            return True
        if self.held or not self._fits(lora):  # arrival order among the held
            self.held.append(req)
            return False
        self._admit(req.request_id, lora)
        return True

    def _fits(self, lora: LoRARequest) -> bool:
        return lora.lora_int_id in self._counts or len(self._counts) < self.max_loras

    def _admit(self, req_id: str, lora: LoRARequest) -> None:
        self._live[req_id] = lora
        self._counts[lora.lora_int_id] += 1

    def forget(self, req_id: str) -> None:
        lora = self._live.pop(req_id, None)
        if lora is not None:
            self._counts[lora.lora_int_id] -= 1
            if not self._counts[lora.lora_int_id]:
                del self._counts[lora.lora_int_id]

    def release(self, is_live: Callable[[str], bool]) -> list[EngineCoreRequest]:
        """Forgets finished requests, then admits the held ones that now fit (in order)."""
        for req_id in [r for r in self._live if not is_live(r)]:
            self.forget(req_id)
        admitted: list[EngineCoreRequest] = []
        while self.held:
            req = self.held[0]
            lora = req.lora_request
            if lora is None or not self._fits(lora):
                break
            self.held.popleft()
            self._admit(req.request_id, lora)
            admitted.append(req)
        return admitted

    def abort_held(self, req_ids: list[str]) -> list[str]:
        """Removes held requests among ``req_ids``; -> those removed."""
        wanted = set(req_ids)
        removed = [r.request_id for r in self.held if r.request_id in wanted]
        if removed:
            self.held = deque(r for r in self.held if r.request_id not in wanted)
        return removed

    def adapter_counts(
        self, running: list[str], waiting: list[str]
    ) -> tuple[dict[str, int], dict[str, int]]:
        """Adapter name -> requests, among the scheduler's ``running`` and ``waiting`` ids
        (the waiting ones with those held here); sorted by name."""
        run = Counter(self._live[r].lora_name for r in running if r in self._live)
        wait = Counter(self._live[r].lora_name for r in waiting if r in self._live)
        wait.update(req.lora_request.lora_name for req in self.held if req.lora_request)
        return dict(sorted(run.items())), dict(sorted(wait.items()))

    def attach(self, new_reqs: list[NewRequestData]) -> None:
        for new in new_reqs:
            new.lora_request = self._live.get(new.req_id)
