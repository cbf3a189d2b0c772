"""``LoRARequest``: which adapter a request runs with (vLLM's field names and order)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class LoRARequest:
    lora_name: str
    lora_int_id: int  # > 0; the worker's cache key (a reload under the same name gets a new id)
    lora_path: str = ""
    base_model_name: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be an integer >= 1, got {self.lora_int_id!r}.")
        if not self.lora_name:
            raise ValueError("lora_name must not be empty.")
        if not self.lora_path:
            raise ValueError(f"LoRA adapter {self.lora_name!r}: lora_path is required.")

    @property
    def hash_key(self) -> str:
        """Mixed into every KV block hash of the request: two adapters never share blocks."""
        return f"lora:{self.lora_int_id}:{self.lora_name}"
