"""Every message that crosses a task channel or the process boundary, declared in one place.

Engine side  -> worker: ``SchedulerOutput`` (P1 -> P2), then ``SampleRequest`` (-> P3).
Worker       -> engine: ``ModelRunnerOutput`` (P3 -> P4).
Engine core  -> output handler: ``EngineCoreOutputs`` (P4 -> stage 10).
Frontend     -> output handler: ``AddRequest`` / ``AbortRequest`` (stage 4, a bounded channel);
Output handler -> engine core: ``EngineCoreRequest`` / ``AbortRequests``.

Per-step messages carry diffs, as vLLM v1 does: a request is sent in full the first time it is
scheduled (and again after a preemption, which drops it on the worker), afterwards only its new
blocks and its computed-token count. Everything here is plain data: dataclasses of ints, floats,
strings, lists and dicts, so the ring buffer can encode it with msgpack (never pickle).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from trillm.lora.request import LoRARequest
from trillm.sampling_params import SamplingParams

if TYPE_CHECKING:
    from trillm.engine.output_collector import RequestOutputCollector


class FinishReason(enum.IntEnum):
    STOP = 0  # EOS, a stop token id or a stop string
    LENGTH = 1  # max_tokens or max_model_len reached
    ABORT = 2  # cancelled by the caller, or the engine shut down

    def __str__(self) -> str:
        return ("stop", "length", "abort")[self.value]


# ---------------------------------------------------------------- frontend -> engine core


# A MultiModalItem of this modality is a prompt given as input embeddings (whole prompt,
# its rows written as given: trillm/engine/prompt_embeds.py).
PROMPT_EMBEDS_MODALITY = "prompt_embeds"


@dataclass(slots=True)
class MultiModalItem:
    """One processed input item (an image's pixel values) and the prompt tokens it fills."""

    modality: str  # "image", "video", "audio", PROMPT_EMBEDS_MODALITY
    content_hash: str  # of the processed data: the encoder cache's key, in extra_hash_keys
    offset: int  # the first placeholder token's position in the prompt
    length: int  # placeholder tokens = the encoder's output rows
    data: bytes  # the processed tensor, float32, C order
    shape: list[int]  # e.g. [3, H, W]
    # M-RoPE: a video's time step per temporal patch (Qwen2.5-VL: tokens_per_second * its
    # seconds; transformers floors k * time_interval)
    time_interval: float = 1.0


@dataclass(slots=True)
class EngineCoreRequest:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float
    eos_token_id: int | None = None
    priority: int = 0  # lower value = scheduled first (--scheduling-policy priority)
    cache_salt: str | None = None
    # Extra keys mixed into every block hash of this request (LoRA name, multimodal hashes).
    extra_hash_keys: list[str] = field(default_factory=list)
    lora_request: LoRARequest | None = None  # its hash_key is in extra_hash_keys
    # Multimodal items in prompt order (their hashes are in extra_hash_keys).
    mm_items: list[MultiModalItem] = field(default_factory=list)


@dataclass(slots=True)
class AbortRequests:
    """Cancelled by the caller, or finished by a stop string in the output handler."""

    request_ids: list[str]


EngineCoreInput = EngineCoreRequest | AbortRequests


# ---------------------------------------------------------------- engine core -> worker


@dataclass(slots=True)
class NewRequestData:
    """A request the worker has not seen (or dropped on preemption): sent in full."""

    req_id: str
    prompt_token_ids: list[int]  # [num_prompt_tokens]
    # Tokens generated before a preemption; they are re-prefilled after the prompt.
    output_token_ids: list[int]  # [num_output_tokens]
    sampling_params: SamplingParams
    block_ids: list[int]  # the request's whole block table
    num_computed_tokens: int  # tokens already in the KV cache (prefix-cache hits)
    # The adapter the request runs with (None: the base model); the schedulers leave it None,
    # the engine core fills it from the EngineCoreRequest.
    lora_request: LoRARequest | None = None
    # Its multimodal items (the engine core fills them, as lora_request).
    mm_items: list[MultiModalItem] = field(default_factory=list)


@dataclass(slots=True)
class CachedRequestData:
    """Requests the worker already holds: only what changed. Parallel lists, one entry each."""

    req_ids: list[str] = field(default_factory=list)
    new_block_ids: list[list[int]] = field(default_factory=list)  # blocks appended this step
    num_computed_tokens: list[int] = field(default_factory=list)  # before this step's tokens

    def __len__(self) -> int:
        return len(self.req_ids)


@dataclass(slots=True)
class SchedulerOutput:
    step_id: int
    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: CachedRequestData
    # req_id -> num_scheduled_tokens (prefill chunk length, or 1 (+ drafts) for decode)
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    # req_id -> draft token ids to verify this step (speculative decoding seam)
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)
    # Finished, aborted or preempted since the last step: the worker drops their state.
    finished_req_ids: list[str] = field(default_factory=list)
    # True when some scheduled request uses structured output: the worker then waits for a
    # SampleRequest carrying the bitmask before P3; otherwise it samples straight away.
    wait_for_bitmask: bool = False
    # Pipeline parallelism only: req_id -> the tokens the last stage sampled for it since the
    # last step sent (its outputs the engine core applied); the other stages append them to
    # their batches before this step's inputs (vLLM sends them the same way). Empty otherwise.
    pp_sampled_token_ids: dict[str, list[int]] = field(default_factory=dict)
    # Content hashes of the encoder outputs the scheduler's encoder cache evicted this step
    # (core/encoder_cache.py): the worker drops them before encoding this step's items.
    free_encoder_mm_hashes: list[str] = field(default_factory=list)
    # --kv-transfer-config only (trillm/kv_transfer/): the prompt KV blocks the worker loads
    # before this step's forward and saves after it. None: no connector.
    kv_connector_step: KVConnectorStep | None = None


@dataclass(slots=True)
class KVTransferItem:
    """One request's prompt KV, stored under ``key``: its first ``num_tokens`` tokens (whole
    blocks) in ``block_ids`` (``num_tokens / block_size`` of them, in order). A load fills
    ``block_ids[first_block:]`` only: the blocks before are the request's prefix-cache hits."""

    req_id: str
    key: str  # the file's name in the shared storage (kv_transfer/storage.py)
    block_ids: list[int]
    num_tokens: int
    first_block: int = 0
    # The KV offload tier (kv_transfer/offload.py) only: its block of each of block_ids
    # (a load reads them into block_ids, a save writes block_ids to them); key is unused.
    offload_blocks: list[int] = field(default_factory=list)
    # The P2P connector's loads only: the prompt's KV (storage.pack's bytes), one share per
    # rank (each rank loads its own), as the decode instance's engine core received it, off
    # the steps (kv_transfer/p2p_recv.py).
    data: list[bytes] | None = None


@dataclass(slots=True)
class KVConnectorStep:
    """vLLM's connector metadata: what the worker side of a KV connector does this step."""

    loads: list[KVTransferItem] = field(default_factory=list)  # before the forward
    saves: list[KVTransferItem] = field(default_factory=list)  # after it


@dataclass(slots=True)
class SampleRequest:
    """P3 trigger when ``wait_for_bitmask`` is set: the grammar bitmask computed during P2."""

    step_id: int
    # req_id -> packed int32 bitmask words [ceil(vocab / 32)], bit set = token allowed: the
    # words' little-endian bytes (msgpack bin, one copy each way; what the engine sends) or a
    # list of words. Only the constrained requests that sample this step have a row.
    bitmask: dict[str, bytes | list[int]] = field(default_factory=dict)


# ---------------------------------------------------------------- worker -> engine core


@dataclass(slots=True)
class LogprobsLists:
    """Logprobs for a run of positions: each row is [sampled/actual token, top-1, ..., top-k]."""

    token_ids: list[list[int]]  # [num_positions][1 + k]
    logprobs: list[list[float]]  # [num_positions][1 + k]
    ranks: list[int]  # [num_positions] rank of the first column's token (1 = argmax)


@dataclass(slots=True)
class ModelRunnerOutput:
    step_id: int
    req_ids: list[str]  # every scheduled request, in batch order
    # [num_reqs][num_new_tokens]: empty for a prefill chunk that does not reach the end
    sampled_token_ids: list[list[int]]
    # req_id -> logprobs of this step's sampled tokens (only requests that asked)
    logprobs: dict[str, LogprobsLists] = field(default_factory=dict)
    # req_id -> logprobs of the prompt positions computed this step (only requests that asked)
    prompt_logprobs: dict[str, LogprobsLists] = field(default_factory=dict)
    model_time_s: float = 0.0  # wall time of P2 + P3 on the worker
    error: str | None = None  # a worker-side failure, reported instead of raising
    # req_id -> why the worker could not take it (its own parameters): only these requests
    # end; the rest of the step ran without them.
    failed: dict[str, str] = field(default_factory=dict)
    # Pooling models: req_id -> its prompt's pooled vector (float32 bytes), the step its
    # prompt completes.
    pooler_output: dict[str, bytes] = field(default_factory=dict)
    # Speculative decoding with a draft model: req_id -> the drafts it proposed for the next
    # step (the engine core trims them to each request's room).
    draft_token_ids: dict[str, list[int]] = field(default_factory=dict)
    # KV connector: req_id -> why its load failed; the step ran without it and the scheduler
    # computes the tokens it did not get (vLLM's kv_load_failure_policy "recompute").
    kv_load_failed: dict[str, str] = field(default_factory=dict)
    # Expert parallelism: [N] (token, expert) pairs this step routed to each rank's experts,
    # summed over the MoE layers (trillm/distributed/expert_parallel.py); [] without it.
    expert_load: list[int] = field(default_factory=list)
    # --collect-detailed-traces (worker/step_timing.py): this step's seconds in the model's
    # forward ("model") / in the worker's execute call ("worker"); None: not collected.
    model_forward_time: float | None = None
    model_execute_time: float | None = None
    # The KV offload tier: [loads, stores] seconds of this rank's tier copies since its last
    # output (worker_side.TimedTransfers; the executor sums the ranks'); [] without the tier.
    kv_offload_seconds: list[float] = field(default_factory=list)


# ---------------------------------------------------------------- engine core -> output handler


@dataclass(slots=True)
class EngineCoreOutput:
    request_id: str
    new_token_ids: list[int]
    new_logprobs: LogprobsLists | None = None
    new_prompt_logprobs: LogprobsLists | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None  # the stop token id that ended it
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache
    # prompt tokens this request computed and wrote to the prefix cache (its full blocks less
    # the hits); on its first output only, as num_cached_tokens.
    num_cache_creation_tokens: int = 0
    # time.time() the request was first scheduled (P1); on its first output only.
    scheduled_time: float | None = None
    pooled: bytes | None = None  # a pooling model's vector (float32 bytes), on the last output
    # --collect-detailed-traces: the request's (forward, execute) seconds so far, summed over
    # the steps that ran it (engine/core_traces.py); None: not collected.
    model_times: tuple[float | None, float | None] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class SpecDecodingStats:
    """Speculative decoding since the engine started (cumulative, vLLM's counters)."""

    num_drafts: int = 0  # verified draft runs (one per request and step with drafts)
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    # [num_speculative_tokens]: drafts accepted at each position of a run
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)


# vLLM's buckets of vllm:kv_offload_{load,store}_size, bytes
KV_OFFLOAD_SIZE_BUCKETS = (1e6, 5e6, 10e6, 20e6, 40e6, 60e6, 80e6, 100e6, 150e6, 200e6)


@dataclass(slots=True)
class TransferSizes:
    """One direction of the KV offload tier's transfers (cumulative): bytes over every rank,
    and each rank's operation sizes as vLLM's histogram counts them (one observation per rank
    and request per step: a worker's transfer job)."""

    bytes: int = 0  # the histograms' sum too
    count: int = 0  # operations observed
    seconds: float = 0.0  # the copies' time, summed over the ranks (as vLLM sums its workers')
    buckets: list[int] = field(default_factory=lambda: [0] * len(KV_OFFLOAD_SIZE_BUCKETS))

    def observe(self, rank_bytes: list[int]) -> None:
        """One request's transfer, ``rank_bytes``: each rank's part."""
        for size in rank_bytes:
            self.bytes += size
            self.count += 1
            for i, bound in enumerate(KV_OFFLOAD_SIZE_BUCKETS):
                if size <= bound:
                    self.buckets[i] += 1


@dataclass(slots=True)
class KVOffloadStats:
    """The KV offload tier's transfers: loads (tier -> KV cache) and stores (KV cache ->
    tier), vLLM's vllm:kv_offload_* series."""

    loads: TransferSizes = field(default_factory=TransferSizes)
    stores: TransferSizes = field(default_factory=TransferSizes)


@dataclass(slots=True)
class SchedulerStats:
    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    # Of the waiting: held until their grammar compiles (vLLM's waiting reason "deferred";
    # the others wait for capacity).
    num_deferred_waiting_reqs: int = 0
    kv_cache_usage: float = 0.0  # fraction of blocks in use, 0..1
    prefix_cache_queries: int = 0  # tokens looked up (cumulative)
    prefix_cache_hits: int = 0  # tokens found (cumulative)
    # Prompt tokens a KV connector was asked for / loaded (cumulative; vLLM's names)
    external_prefix_cache_queries: int = 0
    external_prefix_cache_hits: int = 0
    # vLLM's prompt_tokens_by_source: source -> prompt tokens (cumulative, once per request):
    # "local_compute", "local_cache_hit", "external_kv_transfer" (a KV connector or the KV
    # offload tier loaded them). Empty: not counted (an engine without a KV connector).
    prompt_tokens_by_source: dict[str, int] = field(default_factory=dict)
    num_preemptions: int = 0  # cumulative
    spec_decoding: SpecDecodingStats | None = None  # None: no speculative decoding
    # With --enable-lora: adapter name -> its requests running / waiting (held for a free
    # adapter place, or queued in the scheduler), vLLM's lora_requests_info.
    running_lora_adapters: dict[str, int] = field(default_factory=dict)
    waiting_lora_adapters: dict[str, int] = field(default_factory=dict)
    # Expert parallelism: (token, expert) pairs routed to each rank's experts (cumulative).
    expert_load: list[int] = field(default_factory=list)
    kv_offload: KVOffloadStats | None = None  # None: no --kv-offloading-size


@dataclass(slots=True)
class EngineCoreOutputs:
    outputs: list[EngineCoreOutput]
    timestamp: float
    scheduler_stats: SchedulerStats | None = None
    step_time_s: float = 0.0
    model_time_s: float = 0.0
    num_scheduled_tokens: int = 0  # tokens the step computed (vLLM's iteration tokens)
    engine_index: int = 0  # which engine core (data parallelism) stepped


# ---------------------------------------------------------------- request streams -> output handler


@dataclass(slots=True, eq=False)
class AddRequest:
    """A new user request (``AsyncEngine.generate``). The output handler registers it in the
    output processor, then submits its engine requests (one per sample) to the engine core, so
    no output can arrive before its request is known. In-process only (never encoded)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    engine_requests: list[EngineCoreRequest]
    collector: RequestOutputCollector  # the request's outputs go there
    arrival_time: float  # wall clock (RequestMetrics)


@dataclass(slots=True, eq=False)
class AbortRequest:
    """A stream left before its request finished, its deadline passed, or ``abort`` was
    called. ``collector``: abort only the request reading into it (None: whichever has the id),
    so a late abort never ends a newer request that reuses the id."""

    request_id: str
    collector: RequestOutputCollector | None = None


OutputHandlerInput = EngineCoreOutputs | AddRequest | AbortRequest
