"""Frontend check of the adapters requests name: before any work, so a bad one is a 400.

Each adapter is checked once against the model (config, weight names and shapes; the
weights themselves load in the worker). An adapter id stands for one name and path: a second
adapter under an id in use is refused, since the worker keys its resident adapters by id.
"""

from __future__ import annotations

import trio

from trillm.config import TrillmConfig
from trillm.engine.preprocess import InvalidRequestError
from trillm.lora.peft import AdapterConfig, LoRAAdapterError, check_adapter
from trillm.lora.request import LoRARequest


class LoRAChecker:
    def __init__(self, config: TrillmConfig) -> None:
        assert config.lora is not None
        self.model = config.model
        self.max_lora_rank = config.lora.max_lora_rank
        self._checked: dict[int, tuple[LoRARequest, AdapterConfig]] = {}

    async def check(self, lora: LoRARequest) -> AdapterConfig:
        if not isinstance(lora, LoRARequest):
            raise InvalidRequestError(
                f"lora_request must be a LoRARequest, got {type(lora).__name__}.", "lora_request"
            )
        known = self._checked.get(lora.lora_int_id)
        if known is not None:
            seen, config = known
            if (seen.lora_name, seen.lora_path) != (lora.lora_name, lora.lora_path):
                raise InvalidRequestError(
                    f"lora_int_id {lora.lora_int_id} is already adapter {seen.lora_name!r} "
                    f"({seen.lora_path}); give {lora.lora_name!r} an id of its own.",
                    "lora_request",
                )
            return config
        try:
            # Abandoned when cancelled (a client gone, shutdown): a read stuck in the kernel
            # (a hung network mount) must not hold either.
            config = await trio.to_thread.run_sync(
                check_adapter,
                lora.lora_path,
                self.model,
                self.max_lora_rank,
                abandon_on_cancel=True,
            )
        except LoRAAdapterError as exc:
            raise InvalidRequestError(str(exc), "lora_request") from exc
        self._checked[lora.lora_int_id] = (lora, config)
        return config

    def forget(self, lora_int_id: int) -> None:
        """An unloaded adapter's id (the server never reuses ids)."""
        self._checked.pop(lora_int_id, None)
