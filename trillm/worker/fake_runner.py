"""A deterministic stand-in for ``ModelRunner``: same API, no model, near-zero cost.

Used to drive the scheduler, engine, server and the process machinery fast, and as the
frontend-overhead benchmark's "infinitely fast model". Token ``p`` of request ``r`` (``p``
counts from 0 over prompt + output) is ``fake_token(r, p, vocab)``: a stable hash, the same in
every process and every run, so tests can compute expected outputs independently.

It keeps per-request state like the real runner (prompt, outputs, block table, computed
tokens), updated by the diffs in ``SchedulerOutput``, and checks what the scheduler sends: a
block id outside the cache, or a block table too short for the scheduled tokens, raises
``FakeRunnerError`` (the worker reports it as a step error).
"""

from __future__ import annotations

import time
import zlib
from dataclasses import dataclass, field

import numpy as np

from trillm.config import (
    CacheConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    TrillmConfig,
)
from trillm.messages import LogprobsLists, ModelRunnerOutput, NewRequestData, SchedulerOutput
from trillm.sampling_params import SamplingParams
from trillm.worker.step_timing import ForwardClock

_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


class FakeRunnerError(RuntimeError):
    """The fake runner saw an inconsistent SchedulerOutput, or was told to fail."""


def make_fake_config(
    *,
    vocab_size: int = 4096,
    eos_token_ids: tuple[int, ...] = (2, 0),
    num_blocks: int | None = 256,
    block_size: int = 16,
    max_model_len: int = 2048,
    tensor_parallel_size: int = 1,
    backend: str = "mp",
) -> TrillmConfig:
    """A ``TrillmConfig`` for the fake runner: no model folder needed.

    ``num_blocks`` becomes ``num_gpu_blocks_override`` (None: sized from ``kv_cache_memory``).
    """
    model = ModelConfig(
        model="fake",
        tokenizer="fake",
        served_model_name="fake",
        architecture="FakeForCausalLM",
        dtype="float32",
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        rope_scaling=None,
        max_position_embeddings=max_model_len,
        max_model_len=max_model_len,
        tie_word_embeddings=False,
        attention_bias=False,
        qk_norm=False,
        hidden_act="silu",
        bos_token_id=None,
        eos_token_ids=list(eos_token_ids),
    )
    return TrillmConfig(
        model=model,
        cache=CacheConfig(block_size=block_size, num_gpu_blocks_override=num_blocks),
        scheduler=SchedulerConfig(max_model_len=max_model_len),
        parallel=ParallelConfig(tensor_parallel_size, backend),  # type: ignore[arg-type]
        device="cpu",
    )


def fake_token(req_id: str, position: int, vocab_size: int) -> int:
    """The fake model's token at ``position`` of ``req_id`` (before EOS avoidance)."""
    return zlib.crc32(f"{req_id}:{position}".encode()) % vocab_size


def _allowed(bitmask: list[int], token: int) -> bool:
    return bool((bitmask[token >> 5] >> (token & 31)) & 1)


@dataclass
class _Request:
    req_id: str
    prompt_token_ids: list[int]
    prompt_len: int
    num_tokens: int  # prompt + outputs known to the worker
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    num_output_tokens: int = 0
    output_token_ids: list[int] = field(default_factory=list)


class FakeModelRunner:
    """``ModelRunner``'s API; ``step_sleep_s`` simulates the forward pass's latency."""

    def __init__(
        self,
        config: TrillmConfig,
        rank: int = 0,
        *,
        step_sleep_s: float = 0.0,
        emit_eos_at: int | None = None,
        fail_on_step: int | None = None,
        fail_on_load: bool = False,
    ) -> None:
        self.config = config
        self.rank = rank
        self.vocab_size = config.model.vocab_size
        self.eos_token_ids = list(config.model.eos_token_ids)
        self.step_sleep_s = step_sleep_s
        self.emit_eos_at = emit_eos_at  # output index at which EOS is emitted (None: never)
        self.fail_on_step = fail_on_step
        self.fail_on_load = fail_on_load
        self.num_blocks = 0
        self.requests: dict[str, _Request] = {}
        self._pending: SchedulerOutput | None = None
        self._step_start = 0.0
        self.forward_clock = ForwardClock(config, cuda=False)  # --collect-detailed-traces model

    # ------------------------------------------------------------ lifecycle

    def load_model(self) -> None:
        if self.fail_on_load:
            raise FakeRunnerError("FakeModelRunner told to fail in load_model.")

    def determine_num_blocks(self) -> int:
        cache, model = self.config.cache, self.config.model
        if cache.num_gpu_blocks_override is not None:
            return cache.num_gpu_blocks_override
        per_token = 2 * model.num_hidden_layers * model.num_key_value_heads * model.head_dim
        per_block = per_token * cache.block_size * _DTYPE_BYTES.get(model.dtype, 4)
        return max(1, cache.kv_cache_memory // per_block)

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks

    # ------------------------------------------------------------ P2

    def execute_model(self, sched: SchedulerOutput) -> None:
        self._step_start = time.perf_counter()
        self._pending = None
        if self.fail_on_step == sched.step_id:
            raise FakeRunnerError(f"FakeModelRunner told to fail at step {sched.step_id}.")
        for req_id in sched.finished_req_ids:
            self.requests.pop(req_id, None)
        for new in sched.scheduled_new_reqs:
            self._add_request(new)
        cached = sched.scheduled_cached_reqs
        for req_id, blocks, computed in zip(
            cached.req_ids, cached.new_block_ids, cached.num_computed_tokens
        ):
            req = self._get(req_id)
            req.block_ids.extend(blocks)
            req.num_computed_tokens = computed
        with self.forward_clock:  # the fake model's forward: its checks and step_sleep_s
            for req_id, n in sched.num_scheduled_tokens.items():
                self._check_blocks(self._get(req_id), n)
            if self.step_sleep_s:
                time.sleep(self.step_sleep_s)
        self._pending = sched

    def _add_request(self, new: NewRequestData) -> None:
        num_tokens = len(new.prompt_token_ids) + len(new.output_token_ids)
        self.requests[new.req_id] = _Request(
            req_id=new.req_id,
            prompt_token_ids=list(new.prompt_token_ids),
            prompt_len=len(new.prompt_token_ids),
            num_tokens=num_tokens,
            sampling_params=new.sampling_params,
            block_ids=list(new.block_ids),
            num_computed_tokens=new.num_computed_tokens,
            num_output_tokens=len(new.output_token_ids),
            output_token_ids=list(new.output_token_ids),
        )

    def _get(self, req_id: str) -> _Request:
        req = self.requests.get(req_id)
        if req is None:
            raise FakeRunnerError(f"Request {req_id!r} was scheduled but never sent in full.")
        return req

    def _check_blocks(self, req: _Request, num_scheduled: int) -> None:
        bad = [b for b in req.block_ids if not 0 <= b < self.num_blocks]
        if bad:
            raise FakeRunnerError(
                f"Request {req.req_id!r} uses block ids {bad} outside [0, {self.num_blocks})."
            )
        needed = req.num_computed_tokens + num_scheduled
        capacity = len(req.block_ids) * self.config.cache.block_size
        if needed > capacity:
            raise FakeRunnerError(
                f"Request {req.req_id!r} needs {needed} token slots, its blocks hold {capacity}."
            )

    # ------------------------------------------------------------ P3

    def shutdown(self) -> None:
        """Nothing to leave: no tensor-parallel group, no kernels."""

    def sample_tokens(self, bitmask: dict[str, bytes | list[int]] | None) -> ModelRunnerOutput:
        sched = self._pending
        if sched is None:
            raise FakeRunnerError("sample_tokens called without a successful execute_model.")
        self._pending = None
        req_ids: list[str] = []
        sampled: list[list[int]] = []
        logprobs: dict[str, LogprobsLists] = {}
        prompt_logprobs: dict[str, LogprobsLists] = {}
        for req_id, n in sched.num_scheduled_tokens.items():
            req = self.requests[req_id]
            rows = self._prompt_logprobs(req, n)
            if rows is not None:
                prompt_logprobs[req_id] = rows
            req.num_computed_tokens += n
            req_ids.append(req_id)
            if req.num_computed_tokens < req.num_tokens:  # a prefill chunk short of the end
                sampled.append([])
                continue
            token = self._next_token(req, (bitmask or {}).get(req_id))
            req.output_token_ids.append(token)
            req.num_tokens += 1
            req.num_output_tokens += 1
            sampled.append([token])
            if req.sampling_params.logprobs is not None:
                logprobs[req_id] = self._logprobs(token, req.sampling_params.logprobs)
        out = ModelRunnerOutput(
            step_id=sched.step_id,
            req_ids=req_ids,
            sampled_token_ids=sampled,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            model_time_s=time.perf_counter() - self._step_start,
        )
        return self.forward_clock.stamp(out)

    def _next_token(self, req: _Request, bitmask: bytes | list[int] | None) -> int:
        words: list[int] | None = None
        if isinstance(bitmask, bytes | bytearray | memoryview):  # the int32 words' bytes
            words = np.frombuffer(bitmask, dtype=np.uint32).tolist()
        elif bitmask is not None:
            words = bitmask
        if self.emit_eos_at is not None and req.num_output_tokens == self.emit_eos_at:
            if self.eos_token_ids:
                return self.eos_token_ids[0]
        token = fake_token(req.req_id, req.num_tokens, self.vocab_size)
        for _ in range(self.vocab_size):
            ok = words is None or _allowed(words, token)
            if ok and token not in self.eos_token_ids:
                return token
            token = (token + 1) % self.vocab_size
        for eos in self.eos_token_ids:  # a grammar that is complete allows only EOS
            if words is not None and _allowed(words, eos):
                return eos
        raise FakeRunnerError(f"The bitmask of {req.req_id!r} allows no token.")

    def _logprobs(self, token: int, k: int) -> LogprobsLists:
        row = [token] + [(token + i) % self.vocab_size for i in range(k)]
        # The sampled token is also the top-1 candidate (rank 1), so the first two columns agree.
        lps = [-0.5] + [-0.5 * (i + 1) for i in range(k)]
        return LogprobsLists([row], [lps], [1])

    def _prompt_logprobs(self, req: _Request, num_scheduled: int) -> LogprobsLists | None:
        """As the real runner: this step's prompt rows, row ``p`` scoring prompt token ``p + 1``
        (the fake model gives each the same values as a sampled token's)."""
        k = req.sampling_params.prompt_logprobs
        start = req.num_computed_tokens
        end = min(start + num_scheduled, req.prompt_len - 1)
        if k is None or end <= start:
            return None
        out = LogprobsLists([], [], [])
        for p in range(start, end):
            one = self._logprobs(req.prompt_token_ids[p + 1], k)
            out.token_ids += one.token_ids
            out.logprobs += one.logprobs
            out.ranks += one.ranks
        return out
