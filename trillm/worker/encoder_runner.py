"""The model runner of an encoder-only model (BERT family, ``models/bert.py``, and ModernBERT,
``models/modernbert.py``): it pools, as ``PoolingModelRunner`` does, but each prompt's rows
attend to all the others, so a prompt runs once, whole, in the step that completes it.

The scheduler still schedules prompts in chunks under its token budget (its blocks only
count tokens here: an encoder keeps no KV cache). The runner keeps each prompt's token ids
until its last chunk is scheduled, then runs every prompt completed that step as one padded
batch and pools it: the embedding model's pooled rows (``model_executor/pooling``), or a
cross-encoder's score head (on the first row; ModernBERT's may pool the mean). A prompt
re-sent after a preemption starts over. A pair's segment ids (``[CLS] q [SEP] d [SEP]``: 0s,
then 1s) travel as the index of the first 1 (``SamplingParams.extra_args
["compressed_token_type_ids"]``, vLLM's name); without it every row is segment 0, as
transformers gives a single text.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from trillm.config import TrillmConfig
from trillm.messages import SchedulerOutput
from trillm.model_executor.encoder_config import ACTIVATION_KEY, TOKEN_TYPE_KEY, score_activation
from trillm.model_executor.loader import iterate_weights
from trillm.model_executor.models.bert import BertEncoder
from trillm.model_executor.models.modernbert import ModernBertEncoder
from trillm.model_executor.pooling import finish_pooling
from trillm.model_executor.registry import get_model_class
from trillm.utils import cdiv
from trillm.worker.pooling_runner import PoolingModelRunner, _PoolingStep


@dataclass
class _Prompt:
    ids: list[int]
    segment_b: int | None  # the first row of the second text of a pair
    activation: bool  # a cross-encoder's score through its activation (False: the logit)
    scheduled: int = 0  # rows scheduled so far


class EncoderModelRunner(PoolingModelRunner):
    def __init__(self, config: TrillmConfig, rank: int = 0) -> None:
        super().__init__(config, rank)
        self._prompts: dict[str, _Prompt] = {}
        self._encoder: BertEncoder | ModernBertEncoder | None = None
        self._activation = (
            score_activation(config.model.hf_config) if self.pooler.task == "classify" else ""
        )

    def load_model(self) -> None:
        cfg = self.config.model
        model_class = get_model_class(cfg.architecture)
        assert issubclass(model_class, (BertEncoder, ModernBertEncoder))
        model = model_class(cfg).to(device=self.device, dtype=self.dtype)
        model.load_weights(iterate_weights(cfg.model, device=str(self.device)))
        self._encoder = model.eval()

    def determine_num_blocks(self) -> int:
        """Blocks for max_num_seqs prompts of max_model_len: they hold no memory here."""
        return self.max_num_reqs * cdiv(self.max_model_len, self.block_size)

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.config.cache.num_blocks = num_blocks

    @torch.inference_mode()
    def execute_model(self, sched: SchedulerOutput) -> None:
        start = time.perf_counter()
        for req_id in sched.finished_req_ids:
            self._prompts.pop(req_id, None)
        for new in sched.scheduled_new_reqs:  # re-sent after a preemption: from the start
            extra = new.sampling_params.extra_args or {}
            segment_b = extra.get(TOKEN_TYPE_KEY)
            self._prompts[new.req_id] = _Prompt(
                new.prompt_token_ids,
                None if segment_b is None else int(segment_b),
                bool(extra.get(ACTIVATION_KEY, True)),
            )
        req_ids = list(sched.num_scheduled_tokens)
        complete = []
        for req_id in req_ids:
            prompt = self._prompts[req_id]
            prompt.scheduled += sched.num_scheduled_tokens[req_id]
            if prompt.scheduled >= len(prompt.ids):
                complete.append(req_id)
        pooled = self._pool([self._prompts.pop(r) for r in complete]) if complete else []
        self._num_steps += 1
        step = dict(zip(complete, pooled, strict=True))
        self._step = _PoolingStep(sched.step_id, req_ids, step, {}, start)

    def _pool(self, prompts: list[_Prompt]) -> list[bytes]:
        """One padded batch of whole prompts -> each one's vector (float32 bytes)."""
        assert self._encoder is not None
        ids, types, mask = self._batch(prompts)
        with self.forward_clock:  # --collect-detailed-traces model
            hidden = self._encoder(ids, types, mask)  # [B, S, H]
        if self._encoder.score_head is not None:
            logits = self._encoder.score(hidden, mask).float()  # [B, num_labels]
            vectors = [
                self._score(row, p.activation) for row, p in zip(logits, prompts, strict=True)
            ]
        else:
            vectors = []
            for i, prompt in enumerate(prompts):
                rows = hidden[i, : len(prompt.ids)]
                vectors.append(
                    finish_pooling(self.pooler, rows.float().sum(0), len(rows), rows[0], rows[-1])
                )
        return [v.cpu().numpy().astype(np.float32).tobytes() for v in vectors]

    def _score(self, logits: torch.Tensor, activation: bool) -> torch.Tensor:  # [num_labels]
        if not activation:
            return logits
        if logits.numel() > 1:
            return torch.softmax(logits, dim=-1)
        return logits if self._activation == "identity" else torch.sigmoid(logits)

    def _batch(self, prompts: list[_Prompt]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """ids, token types [B, S] int64 and the mask [B, S] bool, padded to the longest."""
        width = max(len(p.ids) for p in prompts)
        ids = torch.zeros(len(prompts), width, dtype=torch.int64)
        types = torch.zeros_like(ids)
        mask = torch.zeros(len(prompts), width, dtype=torch.bool)
        for i, prompt in enumerate(prompts):
            ids[i, : len(prompt.ids)] = torch.tensor(prompt.ids)
            mask[i, : len(prompt.ids)] = True
            if prompt.segment_b is not None:
                types[i, prompt.segment_b : len(prompt.ids)] = 1
        return ids.to(self.device), types.to(self.device), mask.to(self.device)
