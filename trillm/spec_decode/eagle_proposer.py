"""An EAGLE / EAGLE-3 head in the worker: after P3, it proposes each request's next drafts from
the target's own hidden states (no second target forward).

The head (``eagle_head.py``) has its own small paged KV cache on the target's blocks, laid out
and sized as the draft model's (``draft_model.py``, whose block table, scratch blocks, room and
back-off it reuses). Its row at position ``p`` is fed token ``p + 1`` and the target's state
at ``p``: so it follows the target step by step. P2 leaves the step's states here
(``observe``: the last hidden state for EAGLE, for EAGLE-3 the residual stream before its
three auxiliary layers, captured by hooks on those layers and projected by the head's ``fc``).
After P3 appended the step's tokens, the catch-up forward feeds, for every request of the step,
the positions the target computed whose next token is now known (a partial prefill chunk: all
of them; a verified run: the request's last token and its accepted drafts, not the rejected
ones). A request that sampled has then fed up to position ``num_tokens - 2``, whose row gives
its first draft; each next draft feeds the one before with the head's own state (EAGLE-3:
pre-norm). Drafts are the argmax (EAGLE-3 with its own vocabulary: mapped by ``d2t``), one-hot
proposals the verifier checks exactly, as the draft model's.

A position's head cache is written when the target computes it, so prefix-cached blocks hold
the head's entries of the request that computed them; rejected drafts are overwritten later.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any, Protocol, cast

import numpy as np
import torch
from torch import nn

from trillm.attention.backend import AttentionMetadata
from trillm.attention.kv_layout import KVCacheLayout
from trillm.config import TrillmConfig
from trillm.model_executor.registry import CausalLM
from trillm.spec_decode.draft_model import DraftModelProposer, _Feed
from trillm.spec_decode.eagle_head import EagleHead, normalized_weights
from trillm.worker.input_batch import InputBatch, StepInputs


class DraftHead(Protocol):
    """What the proposer runs: an EAGLE head (``eagle_head.py``) or an MTP layer
    (``mtp_head.py``)."""

    d2t: torch.Tensor | None  # draft id -> target id - draft id; None: the target's ids

    def __call__(
        self,
        embeds: torch.Tensor,  # [T, H]
        positions: torch.Tensor,  # [T]
        hidden: torch.Tensor,  # [T, H]
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]: ...  # (for the logits, to feed back)

    def combine(self, aux: list[torch.Tensor]) -> torch.Tensor: ...  # EAGLE-3's


class EagleProposer(DraftModelProposer):
    def __init__(self, config: TrillmConfig, device: torch.device, kv_dtype: torch.dtype) -> None:
        super().__init__(config, device, kv_dtype)
        self.aux_layers: list[int] = list(self.cfg.hf_config.get("aux_layers", []))
        # EAGLE-3 reads the target's layers through hooks, which replayed steps would skip.
        self.hooks_target = bool(self.aux_layers)
        self._aux: list[torch.Tensor] = []  # [T, H] per auxiliary layer, this step's
        self._step: tuple[StepInputs, torch.Tensor] | None = None  # P2's rows and states
        self._head: DraftHead | None = None
        self._embed: Callable[[torch.Tensor], torch.Tensor] | None = None  # [T] -> [T, H]
        self._logits: Callable[[torch.Tensor], torch.Tensor] | None = None  # [n, H] -> [n, V']

    def load(self, target: CausalLM) -> None:
        weights = list(normalized_weights(self.cfg.model))
        previous = torch.get_default_dtype()
        torch.set_default_dtype(getattr(torch, self.cfg.dtype))
        try:
            with torch.device(self.device):
                head = EagleHead(
                    self.cfg, self.attn_backend, {n for n, _ in weights}, str(self.device)
                )
        finally:
            torch.set_default_dtype(previous)
        head.load_weights(weights)
        model = cast(Any, target)  # a Llama-family model (eagle_config.py checks)
        self._embed = head.embed_tokens or model.embed_input_ids
        self._logits = head.lm_head or model.compute_logits
        for k, index in enumerate(self.aux_layers):
            layer: nn.Module = model.model.layers[index]
            layer.register_forward_pre_hook(partial(self._keep_aux, k))
        self._aux = [torch.empty(0) for _ in self.aux_layers]
        self._head = head

    @property
    def head(self) -> DraftHead:
        if self._head is None:
            raise RuntimeError("EagleProposer.load() has not been called.")
        return self._head

    def cache_layout(self) -> KVCacheLayout:
        return KVCacheLayout.key_value(self.cfg.num_key_value_heads, self.cfg.head_dim)

    def _keep_aux(self, k: int, module: nn.Module, args: tuple[Any, ...]) -> None:
        """A pre-hook on target layer ``aux_layers[k]``: the residual stream entering it (the
        first layer's input is the embeddings, which its norm then adds into: a copy)."""
        hidden, residual = args[1], args[2]
        self._aux[k] = hidden.clone() if residual is None else hidden + residual

    def observe(self, inputs: StepInputs, hidden: torch.Tensor) -> None:
        states = self.head.combine(self._aux) if self.aux_layers else hidden  # [T, H]
        self._step = (inputs, states)

    # ------------------------------------------------------------ proposing

    @torch.inference_mode()
    def propose(self, batch: InputBatch, candidates: list[tuple[str, int]]) -> dict[str, list[int]]:
        step, self._step = self._step, None
        if step is None:
            return {}
        feed, rows = self._catch_up(batch, step[0])
        if not feed.slots:
            return {}
        wanted = {s: n for r, s in candidates if (n := self._wanted(batch, r, s)) > 0}
        out, back, last = self._run(batch, feed, step[1].index_select(0, rows))
        ready = [
            i
            for i, (s, start, t) in enumerate(zip(feed.slots, feed.starts, feed.tokens))
            if s in wanted and start + len(t) == batch.num_tokens[s] - 1
        ]
        if not ready:
            return {}
        pick = last[ready]
        slots = [feed.slots[i] for i in ready]
        drafts = {s: [t] for s, t in zip(slots, self._draft(out.index_select(0, pick)))}
        hidden = back.index_select(0, pick)  # [R, H] the head's state at each one's row
        for n in range(1, max(wanted[s] for s in slots)):
            keep = [j for j, s in enumerate(slots) if wanted[s] > n]
            slots = [slots[j] for j in keep]
            one = _Feed(
                slots,
                [int(batch.num_tokens[s]) - 2 + n for s in slots],
                [np.array([drafts[s][-1]]) for s in slots],
            )
            out, hidden, _ = self._run(batch, one, hidden[keep])
            for s, token in zip(slots, self._draft(out)):
                drafts[s].append(token)
        return {self._slot_req[s]: d for s, d in drafts.items()}

    def _catch_up(self, batch: InputBatch, inputs: StepInputs) -> tuple[_Feed, torch.Tensor]:
        """Per request of the step: its positions whose next token is known now (from the
        first it computed), fed that next token -> (the feed, their rows in the step [Tc])."""
        feed = _Feed([], [], [])
        rows: list[np.ndarray] = []
        qsl = inputs.query_start_loc
        for i, slot in enumerate(inputs.slots.tolist()):
            first = int(qsl[i])
            start = int(inputs.positions[first])
            valid = min(int(qsl[i + 1]) - first, int(batch.num_tokens[slot]) - 1 - start)
            if valid <= 0:
                continue
            feed.slots.append(slot)
            feed.starts.append(start)
            feed.tokens.append(batch.token_ids[slot, start + 1 : start + 1 + valid])
            rows.append(np.arange(first, first + valid))
        index = np.concatenate(rows) if rows else np.zeros(0, np.int64)
        return feed, self._dev(index.astype(np.int64))

    def _run(
        self, batch: InputBatch, feed: _Feed, hidden: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One head forward -> (for the logits [T, H], to feed back [T, H], each request's
        last row [R])."""
        assert self._embed is not None
        meta, positions, last = self._metadata(batch, feed)
        ids = self._dev(np.concatenate(feed.tokens).astype(np.int64))
        out, back = self.head(self._embed(ids), positions, hidden, self.kv_caches, meta)
        return out, back, last

    def _draft(self, states: torch.Tensor) -> list[int]:  # [n, H] -> n target token ids
        assert self._logits is not None
        top = self._logits(states).argmax(dim=-1)
        d2t = self.head.d2t
        return (top if d2t is None else top + d2t[top]).tolist()
