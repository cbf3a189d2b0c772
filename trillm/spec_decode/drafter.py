"""The worker's drafter for ``speculative_config``: a draft model (``draft_model.py``), an
EAGLE / EAGLE-3 head (``eagle_proposer.py``) or the target's MTP layer (``mtp_proposer.py``),
which share one interface."""

from __future__ import annotations

import torch

from trillm.config import TrillmConfig
from trillm.spec_decode.draft_model import DraftModelProposer


def new_drafter(
    config: TrillmConfig, device: torch.device, kv_dtype: torch.dtype
) -> DraftModelProposer:
    assert config.speculative is not None
    if config.speculative.method in ("eagle", "eagle3"):
        from trillm.spec_decode.eagle_proposer import EagleProposer

        return EagleProposer(config, device, kv_dtype)
    if config.speculative.method == "mtp":
        from trillm.spec_decode.mtp_proposer import MtpProposer

        return MtpProposer(config, device, kv_dtype)
    return DraftModelProposer(config, device, kv_dtype)
