"""``{"method": "draft_model", "model": PATH}``, the engine side: the draft's ModelConfig
(checked against the target's vocabulary before anything loads) and ``DraftModelDrafts``, which
hands the drafts the worker's draft model proposed (``draft_model.py``) to the scheduler."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, Literal

from trillm.config import EngineArgs, ModelConfig
from trillm.spec_decode.config import DraftModelError, SpeculativeConfig
from trillm.spec_decode.policy import draft_room, may_speculate

if TYPE_CHECKING:
    from trillm.tokenizer_protocol import Tokenizer

# engine/tokenizer_loader.load_tokenizer: (path, trust_remote_code) -> the tokenizer
TokenizerLoader = Callable[[str, bool], "Tokenizer"]


def build_draft_model_config(
    args: EngineArgs,
    spec: SpeculativeConfig,
    target: ModelConfig,
    load_tokenizer: TokenizerLoader,
) -> ModelConfig:
    """The draft's ModelConfig, in the target's dtype and max_model_len; DraftModelError
    naming what does not match (``load_tokenizer``: path, trust_remote_code -> tokenizer).
    An EAGLE head's: ``eagle_config.py``; MTP layers': ``mtp_config.py``."""
    from trillm.model_executor.model_config import load_model_config

    if spec.method == "mtp":
        from trillm.spec_decode.mtp_config import build_mtp_config

        return build_mtp_config(args, spec, target)
    if spec.method != "draft_model":
        from trillm.spec_decode.eagle_config import build_eagle_head_config

        return build_eagle_head_config(args, spec, target)

    draft_args = EngineArgs(
        model=spec.model,
        dtype=args.dtype,
        device=args.device,
        max_model_len=target.max_model_len,
        revision=None,
    )
    try:
        draft = load_model_config(draft_args)
    except (ValueError, OSError, KeyError) as exc:
        raise DraftModelError(f"speculative_config: draft model {spec.model!r}: {exc}") from None
    if draft.vocab_size != target.vocab_size:
        raise DraftModelError(
            f"speculative_config: draft model {spec.model!r} has a vocabulary of "
            f"{draft.vocab_size} tokens, the target {target.vocab_size}: the draft must use "
            "the target's tokenizer."
        )
    _check_same_tokenizer(spec.model or "", draft, target, args.trust_remote_code, load_tokenizer)
    return draft


def _check_same_tokenizer(
    name: str,
    draft: ModelConfig,
    target: ModelConfig,
    trust_remote_code: bool,
    load_tokenizer: TokenizerLoader,
) -> None:
    """The draft's tokenizer (when its folder has one) maps every token as the target's."""
    try:
        draft_tok = load_tokenizer(draft.tokenizer, trust_remote_code)
    except (OSError, ValueError):
        return  # no tokenizer beside the draft: its vocabulary size matched
    target_tok = load_tokenizer(target.tokenizer, trust_remote_code)
    if draft_tok.get_vocab() != target_tok.get_vocab():
        raise DraftModelError(
            f"speculative_config: draft model {name!r} has a different tokenizer than the "
            "target (their vocabularies differ): the draft must use the target's tokenizer."
        )


class DraftModelDrafts:
    """The engine core's view of a draft model: drafts arrive with the worker's output and
    are trimmed to each request's room (the worker's back-off already chose how many)."""

    in_worker: Literal[True] = True  # drafted in the worker, taken from its output

    def __init__(self, config: SpeculativeConfig, max_model_len: int) -> None:
        self.k = config.num_speculative_tokens
        self.max_model_len = max_model_len

    def take(self, requests: Iterable[Any], proposed: dict[str, list[int]]) -> dict[str, list[int]]:
        """req_id -> drafts for the ready requests the worker proposed for."""
        drafts: dict[str, list[int]] = {}
        if not proposed:
            return drafts
        for request in requests:
            found = proposed.get(request.request_id)
            if not found:
                continue
            room = draft_room(
                self.k,
                self.max_model_len,
                request.num_tokens,
                request.max_tokens,
                request.num_output_tokens,
            )
            if room > 0 and may_speculate(request.sampling_params, request.num_output_tokens):
                drafts[request.request_id] = found[:room]
        return drafts
