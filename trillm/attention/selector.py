"""Chooses the attention backend by name. Kept apart from the interface (``backend.py``),
which the backends import, so that the interface imports none of them."""

from __future__ import annotations

from trillm.attention.backend import AttentionBackend
from trillm.config import ATTENTION_BACKENDS


def get_attention_backend(name: str, device: str) -> AttentionBackend:
    """Backend by name: ``torch`` (CPU or GPU), ``triton`` (GPU, or CPU under the interpreter),
    ``flashinfer`` (GPU only), ``eager`` (transformers' eager attention per request, CPU)."""
    if name == "torch":
        from trillm.attention.torch_backend import TorchAttentionBackend

        return TorchAttentionBackend()
    if name == "triton":
        from trillm.attention.triton_backend import TritonAttentionBackend

        return TritonAttentionBackend()
    if name == "flashinfer":
        if device != "cuda":
            raise ValueError("The flashinfer attention backend needs a CUDA GPU.")
        from trillm.attention.flashinfer_backend import FlashInferAttentionBackend

        return FlashInferAttentionBackend()
    if name == "eager":
        from trillm.attention.eager_backend import EagerAttentionBackend

        return EagerAttentionBackend()
    raise ValueError(f"Unknown attention backend {name!r}; choose {', '.join(ATTENTION_BACKENDS)}.")
