"""The draft model in the worker: after P3, it proposes each request's next drafts.

The draft (a smaller model with the target's tokenizer) runs in the worker process beside the
target, with its own paged KV cache laid out on the target's blocks: the same block ids, the
same slots, separate tensors (so the scheduler's allocation, prefix cache and preemption cover
both). Per batch slot the draft remembers how many of the request's tokens its cache holds
(``num_computed``); a proposal first feeds the tokens it lacks (the whole prompt the first
time, afterwards the tokens accepted since: drafts + the target's own), whose last row gives
the first draft, then ``n - 1`` one-token forwards give the rest (greedy: the draft's argmax,
a one-hot proposal that ``spec_verify`` checks exactly).

Positions past the request's allocated blocks (the drafts' own, and the target's newest token
when the step filled its last block) go to scratch blocks of that slot, past the shared ones,
and are not counted as held: the next proposal feeds them again once the scheduler has
allocated their block. Rejected drafts need no rollback: the cache holds only what
``num_computed`` says, and the next proposal overwrites the rest.

How many drafts a request gets: ``policy.py`` (room, sampling that allows drafts), within the
back-off (``backoff.py``), whose state lives here because the acceptance is known here first.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from trillm.attention.backend import AttentionMetadata
from trillm.attention.kv_layout import KVCacheLayout
from trillm.attention.selector import get_attention_backend
from trillm.config import ModelConfig, TrillmConfig
from trillm.model_executor.registry import CausalLM, kv_cache_layout
from trillm.spec_decode.backoff import SpecBackoff
from trillm.spec_decode.policy import draft_room, may_speculate
from trillm.utils import cdiv
from trillm.worker.input_batch import InputBatch, StepInputs
from trillm.worker.step_program import StepPrograms, step_programs_for


@dataclass
class _Feed:
    """One draft forward's rows, request by request."""

    slots: list[int]
    starts: list[int]  # first position fed, per request
    tokens: list[np.ndarray]  # [q_r] int tokens fed, per request


class DraftModelProposer:
    hooks_target = False  # an EAGLE-3 head reads the target's layers (no replayed steps)

    def __init__(self, config: TrillmConfig, device: torch.device, kv_dtype: torch.dtype) -> None:
        assert config.draft_model is not None and config.speculative is not None
        self.cfg: ModelConfig = config.draft_model
        self.k = config.speculative.num_speculative_tokens
        self.device = device
        self.kv_dtype = kv_dtype
        self.block_size = config.cache.block_size
        self.max_model_len = config.model.max_model_len
        self.max_tokens_per_forward = config.scheduler.max_num_batched_tokens
        max_reqs = config.scheduler.max_num_seqs
        self.attn_backend = get_attention_backend(config.attention_backend, config.device)
        self._model: CausalLM | None = None
        self.kv_caches: list[torch.Tensor] = []
        self.num_computed = np.zeros(max_reqs, dtype=np.int64)  # tokens held, per batch slot
        # Scratch blocks per slot: a request's drafts reach k - 1 positions past its tokens.
        self.scratch_per_slot = cdiv(self.k, self.block_size) + 1
        self._num_shared = 0
        self.backoff = SpecBackoff(self.k)
        self._slot_req: dict[int, str] = {}
        self.config = config
        self.step_programs: StepPrograms | None = None  # its small steps replayed (CPU)

    # ------------------------------------------------------------ lifecycle

    def load(self, target: CausalLM) -> None:
        """Builds the draft (``target``: the model it drafts for, which an EAGLE head reads;
        a draft model runs apart from it)."""
        from trillm.distributed.pipeline import whole_model
        from trillm.model_executor.loader import build_model

        with whole_model():  # on the last pipeline stage: the draft is not split
            self._model = build_model(self.cfg, self.attn_backend, str(self.device))
        self.step_programs = step_programs_for(
            self._model, self.config, self.device, self.attn_backend
        )

    @property
    def model(self) -> CausalLM:
        if self._model is None:
            raise RuntimeError("DraftModelProposer.load() has not been called.")
        return self._model

    def cache_layout(self) -> KVCacheLayout:
        """One draft layer's cache per token (its model's layout)."""
        return kv_cache_layout(self.cfg, self.cfg.num_key_value_heads)

    def block_bytes(self) -> int:
        """Bytes of one shared block over the draft's layers."""
        per_token = self.cfg.num_hidden_layers * self.cache_layout().elements_per_token
        return per_token * self.block_size * self.kv_dtype.itemsize

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self._num_shared = num_blocks
        total = num_blocks + len(self.num_computed) * self.scratch_per_slot
        shape = self.cache_layout().shape(total, self.block_size)
        self.kv_caches = [
            torch.zeros(shape, dtype=self.kv_dtype, device=self.device)
            for _ in range(self.cfg.num_hidden_layers)
        ]

    def add(self, slot: int, req_id: str) -> None:
        """A request took ``slot`` (new, or re-sent after a preemption): nothing held."""
        self.num_computed[slot] = 0
        self._slot_req[slot] = req_id

    def forget_cache(self, slots: list[int]) -> None:
        """After a failed proposal: these slots' draft caches are fed again from the start."""
        self.num_computed[slots] = 0

    def drop(self, slot: int) -> None:
        req_id = self._slot_req.pop(slot, None)
        if req_id is not None:
            self.backoff.forget(req_id)

    # ------------------------------------------------------------ proposing

    def observe(self, inputs: StepInputs, hidden: torch.Tensor) -> None:
        """P2 on the target: its hidden states [T, H] of the step's rows (an EAGLE head reads
        them; a draft model feeds its own tokens)."""

    def record(self, req_id: str, num_drafts: int, num_accepted: int) -> None:
        self.backoff.record(req_id, num_drafts, num_accepted)

    @torch.inference_mode()
    def propose(self, batch: InputBatch, candidates: list[tuple[str, int]]) -> dict[str, list[int]]:
        """candidates: (req_id, slot) of the requests that sampled this step -> req_id ->
        drafts (at most each one's room and back-off limit)."""
        wanted: dict[int, int] = {}  # slot -> drafts
        for req_id, slot in candidates:
            n = self._wanted(batch, req_id, slot)
            if n > 0:
                wanted[slot] = n
        if not wanted:
            return {}
        feed = self._catch_up_feed(batch, wanted)
        ready = [
            s
            for s, start, t in zip(feed.slots, feed.starts, feed.tokens)
            if start + len(t) == batch.num_tokens[s]
        ]
        logits_rows = self._forward(batch, feed)  # [R, V], each request's last row
        self._mark_held(batch, feed)
        last = logits_rows.argmax(dim=-1).cpu().numpy()
        row_of = {s: i for i, s in enumerate(feed.slots)}
        drafts = {s: [int(last[row_of[s]])] for s in ready}
        for step in range(1, max((wanted[s] for s in ready), default=0)):
            going = [s for s in ready if wanted[s] > step]
            one = _Feed(
                going,
                [int(batch.num_tokens[s]) + step - 1 for s in going],
                [np.array([drafts[s][-1]]) for s in going],
            )
            nxt = self._forward(batch, one).argmax(dim=-1).cpu().tolist()
            for s, token in zip(going, nxt):
                drafts[s].append(int(token))
        return {self._slot_req[s]: d for s, d in drafts.items()}

    def _wanted(self, batch: InputBatch, req_id: str, slot: int) -> int:
        params = batch.params[slot]
        if params is None:
            return 0
        num_tokens = int(batch.num_tokens[slot])
        num_output = num_tokens - int(batch.num_prompt_tokens[slot])
        room = draft_room(self.k, self.max_model_len, num_tokens, params.max_tokens, num_output)
        if room <= 0 or not may_speculate(params, num_output):
            return 0
        return min(room, self.backoff.limit(req_id))

    def _catch_up_feed(self, batch: InputBatch, wanted: dict[int, int]) -> _Feed:
        """The tokens each request's draft cache lacks, within one forward's token budget (a
        request cut short proposes at a later step)."""
        feed = _Feed([], [], [])
        budget = self.max_tokens_per_forward
        for slot in wanted:
            start, end = int(self.num_computed[slot]), int(batch.num_tokens[slot])
            take = min(end - start, budget)
            if take <= 0:
                break
            feed.slots.append(slot)
            feed.starts.append(start)
            feed.tokens.append(batch.token_ids[slot, start : start + take])
            budget -= take
        return feed

    def _mark_held(self, batch: InputBatch, feed: _Feed) -> None:
        """Tokens fed into the shared blocks are held; those in scratch blocks are not."""
        for slot, start, tokens in zip(feed.slots, feed.starts, feed.tokens):
            allocated = int(batch.num_blocks[slot]) * self.block_size
            self.num_computed[slot] = min(start + len(tokens), allocated)

    def _forward(self, batch: InputBatch, feed: _Feed) -> torch.Tensor:  # [R, V] float
        """One draft forward over ``feed``; the logits of each request's last row."""
        meta, positions, last = self._metadata(batch, feed)
        input_ids = self._dev(np.concatenate(feed.tokens).astype(np.int64))
        programs = self.step_programs
        hidden = (
            programs.forward(input_ids, positions, self.kv_caches, meta)  # [T, H]
            if programs is not None and programs.applies(meta)
            else self.model(input_ids, positions, self.kv_caches, meta)
        )
        assert isinstance(hidden, torch.Tensor)  # the draft is built whole (``whole_model``)
        return self.model.compute_logits(hidden.index_select(0, last)).float()

    def _metadata(
        self, batch: InputBatch, feed: _Feed
    ) -> tuple[AttentionMetadata, torch.Tensor, torch.Tensor]:
        """A forward over ``feed``: its planned attention metadata, positions [T] and the row
        of each request's last token [R] (on the device)."""
        counts = np.array([len(t) for t in feed.tokens], dtype=np.int64)
        qsl = np.zeros(len(counts) + 1, dtype=np.int32)
        np.cumsum(counts, out=qsl[1:])
        starts = np.array(feed.starts, dtype=np.int64)
        seq_lens = starts + counts
        positions = np.concatenate([np.arange(s, s + c) for s, c in zip(starts, counts)])
        table = self._block_table(batch, feed.slots, seq_lens)  # [R, B]
        row_req = np.repeat(np.arange(len(counts)), counts)
        blocks = table[row_req, positions // self.block_size].astype(np.int64)
        meta = AttentionMetadata(
            num_reqs=len(counts),
            num_tokens=int(qsl[-1]),
            query_start_loc=self._dev(qsl),
            seq_lens=self._dev(seq_lens.astype(np.int32)),
            context_lens=self._dev(starts.astype(np.int32)),
            block_table=self._dev(table),
            slot_mapping=self._dev(blocks * self.block_size + positions % self.block_size),
            max_query_len=int(counts.max()),
            max_seq_len=int(seq_lens.max()),
            query_lens_cpu=counts.tolist(),
            seq_lens_cpu=seq_lens.tolist(),
        )
        self.attn_backend.plan(meta)
        return meta, self._dev(positions), self._dev(qsl[1:].astype(np.int64) - 1)

    def _block_table(self, batch: InputBatch, slots: list[int], seq_lens: np.ndarray) -> np.ndarray:
        """[R, B] int32: each request's shared blocks, then its slot's scratch blocks for its
        positions past them (columns past a request's own length stay 0: never read)."""
        needed = -(-seq_lens // self.block_size)  # [R] blocks each request's positions reach
        table = np.zeros((len(slots), int(needed.max())), dtype=np.int32)
        for i, slot in enumerate(slots):
            want = int(needed[i])
            n = min(int(batch.num_blocks[slot]), want)
            table[i, :n] = batch.block_table[slot, :n]
            extra = want - n
            if extra > self.scratch_per_slot:
                raise RuntimeError(
                    f"draft positions reach {extra} blocks past slot {slot}'s "
                    "allocation; the scratch holds fewer"
                )
            first = self._num_shared + slot * self.scratch_per_slot
            table[i, n:want] = np.arange(first, first + extra)
        return table

    def _dev(self, a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(a)).to(self.device)
