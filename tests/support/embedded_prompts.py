"""The embedded model's prompts and limits for the quantized end-to-end runs (fp8, AWQ/GPTQ)."""

from __future__ import annotations

SMALL = {"max_model_len": 256, "kv_cache_memory": "16MiB", "distributed_executor_backend": "uni"}
PROMPTS = [
    "In the beginning God created",
    "And the LORD said unto Moses,",
    "Blessed are the meek: for",
    "The king of Babylon came",
    "And it came to pass, when",
    "Thou shalt not",
    "Then Jesus answered and said",
    "Let every soul be subject unto",
]
TEXT = " ".join(PROMPTS) + (
    " And he went up into the mountain, and called unto him whom he would: and they came unto him."
)
