"""The model runner (stages 6-8 on the worker): persistent batch, paged KV cache, forward, sample.

``execute_model`` (P2) applies the step's diffs to the persistent batch, builds the flattened
inputs and runs the forward pass, keeping the logits of the rows that sample (the last row of
each request whose computed + scheduled tokens reach its token count) and of the prompt rows
whose logprobs were asked for. ``sample_tokens`` (P3, ``token_sampler.py``) samples, appends
the tokens to the batch and returns ``ModelRunnerOutput`` in batch order (the order of
``num_scheduled_tokens``).

Prompt logprobs: row ``p`` scores prompt token ``p + 1``: P - 1 rows for a prompt of P tokens.

Tensor parallelism (``tensor_parallel_size`` N > 1): the runner of rank r joins the group
(``trillm/distributed/``) before it builds its shard of the model, and its KV cache holds its
own KV heads. Every rank receives the same steps and gathers the whole logits row, and every
rank samples: the same logits (the all-gather gives each rank the same bytes), the same sampling
state and the same seeds give the same tokens, so each rank's batch stays in step with no extra
collective per step (the executor checks that every rank returned rank 0's tokens).

Pipeline parallelism (``pipeline_parallel_size`` M > 1, ``trillm/distributed/pipeline.py``):
the runner of global rank g holds stage g // N's layers and KV cache only; a stage after the
first receives the hidden states before its layers, a stage before the last sends them after;
only the last stage computes logits and samples; the other ranks append its tokens when the
engine core sends them with a later step (``pipeline_tokens.py``), so that several steps can be
in flight, one per stage.
"""

from __future__ import annotations

import logging
import time

import numpy as np
import torch

from trillm.attention.selector import get_attention_backend
from trillm.attention.ssm_state import SSMStateCache
from trillm.config import TrillmConfig
from trillm.distributed.cpu_binding import bind_rank
from trillm.distributed.pipeline import IntermediateTensors, get_pp_group
from trillm.distributed.sharding import RankShapes
from trillm.distributed.worker import join_tensor_parallel, leave_tensor_parallel, place_rank
from trillm.errors import CollectiveTimeoutError
from trillm.kv_transfer.worker_side import take_transfer_seconds, worker_connector
from trillm.lora.manager import LoRAManager
from trillm.lora.request import LoRARequest
from trillm.messages import ModelRunnerOutput, SchedulerOutput
from trillm.model_executor.layers.fused_moe import exchange_without_tokens
from trillm.model_executor.layers.rotary import longrope_index
from trillm.model_executor.loader import build_model
from trillm.model_executor.registry import CausalLM, kv_cache_layout, ssm_state_layout
from trillm.sample.custom_batch import build_custom_processors
from trillm.sample.sampler import SamplingState
from trillm.spec_decode.draft_model import DraftModelProposer
from trillm.spec_decode.drafter import new_drafter
from trillm.utils import cdiv
from trillm.worker import kv_cache_sizing, mm_inputs
from trillm.worker.input_batch import InputBatch, StepInputs
from trillm.worker.kv_pages import zeros_on_huge_pages
from trillm.worker.longrope_state import LongRopeState
from trillm.worker.mm_inputs import MultiModalInputs, add_items, drop_items, set_mm_rows
from trillm.worker.pipeline_tokens import append_sampled
from trillm.worker.spec_verify import expand_rows, num_drafts_of
from trillm.worker.step_program import StepPrograms, step_programs_for
from trillm.worker.step_sampling import Bitmask, PendingStep, prompt_logprobs_inputs
from trillm.worker.step_timing import ForwardClock
from trillm.worker.token_sampler import TokenSampler, output_before_last_stage

logger = logging.getLogger(__name__)


class ModelRunner:
    def __init__(self, config: TrillmConfig, rank: int = 0) -> None:
        self.config = config
        self.rank = rank
        self.device = torch.device(config.device)
        model_cfg = config.model
        self.tp_size = config.parallel.tensor_parallel_size
        self.world_size = config.parallel.world_size
        expert_parallel = config.parallel.enable_expert_parallel
        self.shapes = RankShapes.of(model_cfg, rank % self.tp_size, self.tp_size, expert_parallel)
        self.kv_layout = kv_cache_layout(model_cfg, self.shapes.num_kv_heads)  # a layer's, a token
        self.ssm: SSMStateCache | None = None  # their states, one row per batch slot
        self._num_steps = 0
        if config.parallel.joins_group:  # several ranks in the core, or -dp N -ep
            self.device = join_tensor_parallel(config, rank)
        elif config.parallel.data_parallel_size > 1:
            self.device = place_rank(config, rank)  # engine core d's GPU, or its CPU share
        elif self.device.type == "cpu":  # a rank alone: its cores and threads
            bind_rank(config.parallel, rank)
        self.pp = get_pp_group()  # this rank's pipeline stage (the whole model with one)
        # a hybrid's Mamba layers of this stage, a request's state on this rank
        self.ssm_layout = ssm_state_layout(model_cfg, self.tp_size)
        self.dtype = getattr(torch, model_cfg.dtype)
        self.kv_dtype = kv_cache_sizing.kv_cache_dtype(config)
        self.block_size = config.cache.block_size
        self.max_num_reqs = config.scheduler.max_num_seqs
        self.max_model_len = model_cfg.max_model_len
        torch.manual_seed(config.seed)
        self._model: CausalLM | None = None
        self.attn_backend = get_attention_backend(config.attention_backend, config.device)
        self.kv_caches: list[torch.Tensor] = []
        self.kv_connector = worker_connector(config, rank)  # --kv-transfer-config's worker side
        self._kv_load_failed: dict[str, str] = {}  # the step's requests whose KV load failed
        self.forward_clock = ForwardClock(config)  # --collect-detailed-traces model
        self.batch = InputBatch(
            self.max_num_reqs,
            self.max_model_len,
            self.block_size,
            max_blocks_per_req=cdiv(self.max_model_len, self.block_size),
        )
        self.sampling_state = SamplingState(self.max_num_reqs, model_cfg.vocab_size, self.device)
        self.sampling_state.custom = build_custom_processors(config, self.device)
        self._pending: PendingStep | None = None
        self.lora: LoRAManager | None = None  # with --enable-lora, once the model is loaded
        self.step_programs: StepPrograms | None = None  # small decode steps replayed (CPU)
        self.mm: MultiModalInputs | None = None  # a vision-language model's items and encoder
        # A longrope model's tables per token and crossing step (longrope_state.py).
        self.longrope: LongRopeState | None = None
        # speculative_config's draft_model: proposes each step's next drafts after P3, on the
        # output rank only (the last pipeline stage's first tensor-parallel rank, whose output
        # the executor returns), whole; every rank verifies the drafts the next step carries.
        self.drafter: DraftModelProposer | None = None
        if config.draft_model is not None and self.pp.is_last and self.pp.tp_rank == 0:
            self.drafter = new_drafter(config, self.device, self.kv_dtype)
        self.token_sampler = TokenSampler(  # P3 on the last stage
            self.batch, self.sampling_state, self.drafter, model_cfg.vocab_size, self.device
        )

    # ------------------------------------------------------------ lifecycle
    def shutdown(self) -> None:
        """Leave the tensor-parallel group (the worker calls this on Shutdown)."""
        if self.config.parallel.joins_group:
            leave_tensor_parallel(self.rank, self._num_steps)

    def load_model(self) -> None:
        self._model = build_model(self.config.model, self.attn_backend, self.config.device)
        self.mm = MultiModalInputs.for_model(  # the tower runs on the first stage only
            self._model, self.device, self.config.enable_prompt_embeds, self.pp.is_first
        )
        if (index := longrope_index(self._model)) is not None:
            self.longrope = LongRopeState(index, self.max_num_reqs)
        if self.drafter is not None:
            self.drafter.load(self._model)
        lora = self.config.lora
        if lora is not None:
            self.lora = LoRAManager(
                self._model,
                self.config.model,
                lora.max_loras,
                lora.max_lora_rank,
                self.device,
                self.dtype,
                max_cpu_loras=lora.max_cpu_loras,
            )
        # NOTE: a replay would not see the step's state rows, nor run an EAGLE-3 head's hooks
        hooks = self.drafter is not None and self.drafter.hooks_target
        if self.ssm_layout is None and not hooks:
            self.step_programs = step_programs_for(
                self.model, self.config, self.device, self.attn_backend, self.lora is not None
            )

    @property
    def model(self) -> CausalLM:
        if self._model is None:
            raise RuntimeError("ModelRunner.load_model() has not been called.")
        return self._model

    @property
    def num_layers(self) -> int:
        """Layers this rank runs and caches (its pipeline stage's)."""
        if self.pp.num_stages == 1:
            return self.config.model.num_hidden_layers
        return self.pp.end_layer - self.pp.start_layer

    @property
    def num_kv_layers(self) -> int:
        """Layers holding the paged KV cache (a hybrid's attention layers only)."""
        return self.num_layers if self.ssm_layout is None else self.ssm_layout.kv_layers

    def kv_block_bytes(self) -> int:
        """Bytes of one block over this rank's layers (and the draft model's, if any)."""
        draft = 0 if self.drafter is None else self.drafter.block_bytes()
        return kv_cache_sizing.block_bytes(
            self.config, self.num_kv_layers, self.kv_layout, self.kv_dtype, draft
        )

    def ssm_state_bytes(self) -> int:
        """Bytes of every batch slot's Mamba states (0 without Mamba layers)."""
        layout = self.ssm_layout
        return 0 if layout is None else layout.bytes_per_request(self.dtype) * self.max_num_reqs

    def determine_num_blocks(self) -> int:
        return kv_cache_sizing.num_blocks(
            self.config, self.kv_block_bytes(), self.device, self.shapes, self.ssm_state_bytes()
        )

    def initialize_kv_cache(self, num_blocks: int) -> None:
        shape = self.kv_layout.shape(num_blocks, self.block_size)
        layer = (shape, self.kv_dtype, self.device)
        self.kv_caches = [zeros_on_huge_pages(*layer) for _ in range(self.num_kv_layers)]
        if self.ssm_layout is not None:
            self.ssm = SSMStateCache(self.ssm_layout, self.max_num_reqs, self.dtype, self.device)
        self.config.cache.num_blocks = num_blocks
        if self.drafter is not None:
            self.drafter.initialize_kv_cache(num_blocks)

    # ------------------------------------------------------------ P2
    @torch.inference_mode()
    def execute_model(self, sched: SchedulerOutput) -> None:
        start = time.perf_counter()
        self._pending = None
        failed = self._update_batch(sched)
        self._kv_load_failed = self.kv_connector.start_load_kv(
            sched.kv_connector_step, self.kv_caches
        )
        skip = failed | self._kv_load_failed  # NOTE: the load-failed are recomputed, not failed
        req_ids = [r for r in sched.num_scheduled_tokens if r not in skip]
        drafts = {r: d for r, d in sched.scheduled_spec_decode_tokens.items() if r not in skip}
        for req_id, tokens in drafts.items():
            self.batch.write_drafts(self.batch.slot_of(req_id), tokens)
        if not req_ids:  # no forward; -dp N -ep: the other cores' ranks wait in its exchanges
            if self.config.parallel.experts_span_cores and isinstance(self.model, torch.nn.Module):
                exchange_without_tokens(self.model, self.dtype, self.device)  # with no tokens
            empty = torch.empty(0, self.config.model.vocab_size, device=self.device)
            inputs = self.batch.prepare(np.zeros(0, np.int64), np.zeros(0, np.int64))
            self._pending = PendingStep(
                sched.step_id, [], inputs, empty, None, None, start_time=start, failed=failed
            )
            return
        slots = np.array([self.batch.slot_of(r) for r in req_ids], dtype=np.int64)
        num_scheduled = np.array([sched.num_scheduled_tokens[r] for r in req_ids], np.int64)
        recomputed = np.zeros(len(slots), dtype=bool)
        if self.longrope is not None:
            num_scheduled, recomputed = self.longrope.widen_step(self.batch, slots, num_scheduled)
        inputs = self.batch.prepare(slots, num_scheduled)
        if self.lora is None:
            hidden = self._forward(inputs)  # [T, H]
        else:
            with self.lora.step(req_ids, inputs.query_start_loc):
                hidden = self._forward(inputs)
        self._num_steps += 1
        self.kv_connector.wait_for_save(sched.kv_connector_step, self.kv_caches)
        if hidden is None:  # not the last pipeline stage: it samples, we take its tokens
            empty = torch.empty(0, self.config.model.vocab_size, device=self.device)
            self._pending = PendingStep(
                sched.step_id,
                req_ids,
                inputs,
                empty,
                None,
                None,
                start_time=start,
                failed=failed,
                drafts=drafts,
            )
            return
        if self.drafter is not None:  # an EAGLE head reads the target's states of the step
            self.drafter.observe(inputs, hidden)
        rows = inputs.sample_rows
        num_drafts = row_owner = row_offset = None
        if drafts:  # every drafted position of a request samples: its last d + 1 rows
            num_drafts = num_drafts_of(req_ids, drafts, inputs.sample_reqs)
            rows, row_owner, row_offset = expand_rows(rows, num_drafts)
        sample_rows = torch.from_numpy(rows).to(self.device)
        sample_logits = self.model.compute_logits(hidden.index_select(0, sample_rows)).float()
        pending = PendingStep(
            sched.step_id,
            req_ids,
            inputs,
            sample_logits,
            None,
            None,
            start_time=start,
            failed=failed,
            drafts=drafts,
            num_drafts=num_drafts,
            row_owner=row_owner,
            row_offset=row_offset,
        )
        prompt_logprobs_inputs(self.batch, self.model, pending, hidden, num_scheduled, recomputed)
        self._pending = pending

    def _update_batch(self, sched: SchedulerOutput) -> dict[str, str]:
        """Applies the step's diffs; returns the new requests that could not be taken
        (req_id -> why): the step runs without them, and only they fail."""
        failed: dict[str, str] = {}
        if sched.pp_sampled_token_ids and not self.pp.is_last:  # before a drop or a re-send
            append_sampled(sched.pp_sampled_token_ids, self.batch, self.sampling_state)
        for req_id in sched.finished_req_ids:
            self._drop(req_id)
        for new in sched.scheduled_new_reqs:
            self._drop(new.req_id)  # re-sent after a preemption
            try:
                slot = self.batch.add_request(new)
                add_items(self.mm, slot, new.mm_items)
                if self.longrope is not None:
                    self.longrope.reset(slot)
                if self.drafter is not None:
                    self.drafter.add(slot, new.req_id)
                self.sampling_state.add_request(
                    slot, new.sampling_params, new.prompt_token_ids, new.output_token_ids
                )
                if new.lora_request is not None:
                    self._add_lora(new.req_id, new.lora_request)
            except Exception as exc:  # NOTE: one request's parameters, not the step's fault
                logger.warning("request %s refused by the worker: %r", new.req_id, exc)
                failed[new.req_id] = f"{type(exc).__name__}: {exc}"
                self._drop(new.req_id)
        cached = sched.scheduled_cached_reqs
        for req_id, blocks, computed in zip(
            cached.req_ids, cached.new_block_ids, cached.num_computed_tokens
        ):
            slot = self.batch.slot_of(req_id)
            self.batch.append_blocks(slot, blocks)
            self.batch.num_computed[slot] = computed
        return failed | mm_inputs.encode_step(self.mm, sched, self.batch, failed)

    def _add_lora(self, req_id: str, lora: LoRARequest) -> None:
        if self.lora is None:
            raise ValueError("LoRA is not enabled on this engine (enable_lora / --enable-lora).")
        self.lora.add_request(req_id, lora)

    def _drop(self, req_id: str) -> None:
        if self.lora is not None:
            self.lora.remove_request(req_id)
        slot = self.batch.remove_request(req_id)
        drop_items(self.mm, slot)
        if slot is not None and self.drafter is not None:
            self.drafter.drop(slot)
        if slot is not None and self.sampling_state.holds(slot):
            self.sampling_state.remove_request(slot)

    def _forward(self, inputs: StepInputs) -> torch.Tensor | None:  # [T, H]; None: not last
        received = None
        # What one stage hands the next (IntermediateTensors): the hidden states and, where the
        # model carries it, the residual stream, each [T, H] in the model's dtype.
        shape = (len(inputs.input_ids), self.config.model.hidden_size)
        count = 2 if self.model.PP_CARRIES_RESIDUAL else 1
        if not self.pp.is_first:
            received = IntermediateTensors(*self.pp.recv(count, shape, self.dtype, self.device))
        try:
            with self.forward_clock:
                return self._run_stage(inputs, received)
        except CollectiveTimeoutError:
            raise  # the group is broken: nothing more can be sent
        except Exception:
            if not self.pp.is_last:
                # The next stage waits in recv (its own run of the call above) for this step's
                # `count` tensors of `shape`: zero placeholders for the hidden states and the
                # residual, made from the same description, end its step now (this rank's error
                # fails the step at the executor), instead of leaving it there until the
                # collective timeout.
                self.pp.send(
                    [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(count)]
                )
            raise

    def _run_stage(
        self, inputs: StepInputs, received: IntermediateTensors | None
    ) -> torch.Tensor | None:
        meta = inputs.attention_metadata(self.device)
        if self.mm is not None:  # Gemma 3: an image's tokens attend both ways
            meta.bidirectional_spans = self.mm.bidirectional_spans(inputs)
        if self.ssm is not None:
            meta.ssm = self.ssm.step(inputs.slots, inputs.context_lens, inputs.query_start_loc)
        self.attn_backend.plan(meta)
        input_ids = torch.from_numpy(inputs.input_ids).to(self.device)
        positions = torch.from_numpy(self._rope_positions(inputs)).to(self.device)
        programs = None if set_mm_rows(self.mm, self.model, inputs) else self.step_programs
        if received is None and programs is not None and programs.applies(meta):
            return programs.forward(input_ids, positions, self.kv_caches, meta)
        out = self.model(input_ids, positions, self.kv_caches, meta, received)
        if isinstance(out, IntermediateTensors):
            self.pp.send(out.tensors())
            return None
        return out

    def _rope_positions(self, inputs: StepInputs) -> np.ndarray:  # [T] (M-RoPE: [3, T]) int64
        """What the model's rotary embedding indexes: the positions, or for longrope each
        token's row in the [short; long] table (M-RoPE, Qwen2-VL: [3, T] from the images)."""
        if self.longrope is not None:
            return self.longrope.batch_rope_positions(self.batch, inputs)
        return inputs.positions if self.mm is None else self.mm.rope_positions(inputs)

    # ------------------------------------------------------------ P3
    def pending_step(self) -> PendingStep | None:  # interfaces.PendingStepRunner
        return self._pending

    @torch.inference_mode()
    def sample_tokens(self, bitmask: Bitmask | None) -> ModelRunnerOutput:
        pending = self._pending
        if pending is None:
            raise RuntimeError("sample_tokens called without a successful execute_model.")
        self._pending = None
        last, sampler = self.pp.is_last, self.token_sampler  # NOTE: the last stage samples
        out = sampler.sample(pending, bitmask) if last else output_before_last_stage(pending)
        out.kv_load_failed = self._kv_load_failed if last else {}
        out.kv_offload_seconds = take_transfer_seconds(self.kv_connector)  # the offload tier's
        return self.forward_clock.stamp(out)
