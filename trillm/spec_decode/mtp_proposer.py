"""The target's MTP layer in the worker (``mtp_head.py``): drafting as an EAGLE head does
(``eagle_proposer.py``: the target's final states from P2, the head's own paged cache, the
catch-up on the positions whose next token is known, k drafts each feeding the layer's own
state back), on a one-layer latent cache laid out as the target's (MLA)."""

from __future__ import annotations

import torch

from trillm.attention.kv_layout import KVCacheLayout
from trillm.model_executor.registry import CausalLM, kv_cache_layout
from trillm.spec_decode.eagle_proposer import EagleProposer
from trillm.spec_decode.mtp_head import MtpHead, mtp_weights


class MtpProposer(EagleProposer):
    def load(self, target: CausalLM) -> None:
        """Builds the layer from the target's checkpoint (``target`` itself is not read: the
        layer has its own embeddings and head, or copies of the target's)."""
        weights = mtp_weights(self.cfg.model, int(self.cfg.hf_config["mtp_layer"]))
        previous = torch.get_default_dtype()
        torch.set_default_dtype(getattr(torch, self.cfg.dtype))
        try:
            with torch.device(self.device):
                head = MtpHead(self.cfg, str(self.device))
        finally:
            torch.set_default_dtype(previous)
        head.load_weights(weights)
        head.eval()
        self._embed = head.embed_tokens
        self._logits = head.layer.shared_head.head
        self._head = head

    def cache_layout(self) -> KVCacheLayout:
        """MLA's: the latent and the roped key, one row per token."""
        return kv_cache_layout(self.cfg, self.cfg.num_key_value_heads)
