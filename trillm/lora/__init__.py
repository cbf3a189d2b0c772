"""LoRA adapters (vLLM's API): requests name one, workers apply several in one batch.

``request.py``: ``LoRARequest`` (vLLM's fields). ``peft.py``: PEFT adapter folders, read and
checked (what is not implemented is refused, naming it); ``files.py``: its files read as bounded
regular files. ``layers.py``: the batched LoRA
delta on the targeted linears (per-token adapter slot, shrink / expand kernels). ``manager.py``: the worker's resident
adapters (at most ``max_loras``, least recently used evicted).
"""

from trillm.lora.request import LoRARequest

__all__ = ["LoRARequest"]
