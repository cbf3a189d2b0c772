"""The resolved configuration the engine runs with: ``TrillmConfig`` and its parts (model,
cache, scheduler, parallel, LoRA), built by ``trillm/engine/config_builder.py``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from trillm.config.logits_processors import LogitsProcessorSpec
from trillm.config.mm_processor_cache import DEFAULT_MM_PROCESSOR_CACHE_GB
from trillm.config.pooling import PoolerConfig
from trillm.config.structured_outputs import StructuredOutputsConfig
from trillm.config.values import DEFAULT_GRAMMAR_CACHE_BYTES, DEFAULT_KV_CACHE_MEMORY
from trillm.kv_transfer.config import KVTransferConfig
from trillm.kv_transfer.offload_config import KVOffloadConfig
from trillm.spec_decode.config import SpeculativeConfig


@dataclass
class ModelConfig:
    """The model as the runner needs it, read from config.json (transformers 4 or 5 keys)."""

    model: str  # local folder holding config.json, weights and tokenizer; or a .gguf file
    tokenizer: str
    served_model_name: str
    architecture: str  # e.g. "LlamaForCausalLM"
    dtype: str  # "float32" | "bfloat16" | "float16"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    max_model_len: int
    tie_word_embeddings: bool
    attention_bias: bool  # q/k/v projections carry a bias (Qwen2)
    qk_norm: bool  # per-head RMSNorm on q and k (Qwen3)
    hidden_act: str
    bos_token_id: int | None
    eos_token_ids: list[int]
    generation_config: dict[str, Any] = field(default_factory=dict)
    hf_config: dict[str, Any] = field(default_factory=dict)
    quantization: str | None = None  # "fp8" (at load, CPU) | "gguf" (a GGUF's blocks) | awq | gptq
    numerics: str = "fast"  # EngineArgs.numerics: "fast" | "transformers"
    # A vision-language model's whole config.json (vision tower, projector, placeholder
    # token); the fields above are its language model's (text_config). None: a text model.
    mm_config: dict[str, Any] | None = None
    load_format: str = "auto"  # EngineArgs.load_format; "dummy": random weights, none read


@dataclass
class CacheConfig:
    block_size: int = 16
    # The KV cache's storage: "float32" | "bfloat16" | "float16" | "fp8_e4m3" (resolved from
    # kv_cache_dtype; "auto" is the model's dtype). fp8 values are stored as x / scale with
    # the scale 1.0 (vLLM's default when no scales are calculated or loaded).
    cache_dtype: str = "auto"
    enable_prefix_caching: bool = True
    kv_cache_memory: int = DEFAULT_KV_CACHE_MEMORY
    gpu_memory_utilization: float = 0.9
    num_gpu_blocks_override: int | None = None
    num_blocks: int = 0  # set once the worker has sized the cache


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int = 2048
    long_prefill_token_threshold: int = 0  # 0 = no per-request cap beyond the budget
    policy: Literal["fcfs", "priority"] = "fcfs"


# A collective that waits longer than this means a rank stopped answering; below the
# executor's step timeout, so the rank that waited reports it first.
COLLECTIVE_TIMEOUT_S = 120.0


@dataclass
class ParallelConfig:
    tensor_parallel_size: int = 1
    distributed_executor_backend: Literal["mp", "uni", "ray"] = "mp"
    master_port: int = 0  # the ranks' TCP rendezvous (0: the executor picks a loopback port)
    collective_timeout_s: float = COLLECTIVE_TIMEOUT_S
    data_parallel_size: int = 1  # engine cores (each gets its own copy of the config)
    data_parallel_rank: int = 0  # which engine core this config's workers serve
    nnodes: int = 1  # node k runs ranks [k * L, (k + 1) * L), L = ranks_per_node
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    pipeline_parallel_size: int = 1  # stages; world = tensor x pipeline ranks
    enable_expert_parallel: bool = False  # MoE experts spread over the tensor-parallel ranks
    # -dp N -ep: the file every core's ranks meet at (one world for the experts' all-to-alls,
    # engine/dp_router.core_configs); "" otherwise.
    expert_store: str = ""

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def experts_span_cores(self) -> bool:
        """-dp N -ep: the experts spread over every engine core's ranks, which step in
        lock-step (engine/dp_lockstep.py)."""
        return self.enable_expert_parallel and self.data_parallel_size > 1

    @property
    def joins_group(self) -> bool:
        """Whether each rank joins a torch.distributed group (several ranks in its core, or
        the experts spread over the cores)."""
        return self.world_size > 1 or self.experts_span_cores

    @property
    def ranks_per_node(self) -> int:
        return self.world_size // self.nnodes

    def remote_ranks(self) -> list[int]:
        """The ranks not on node 0 (rank 0 forwards the executor's messages to them)."""
        return list(range(self.ranks_per_node, self.world_size))


@dataclass
class LoRAConfig:
    max_loras: int = 1  # adapters resident on a worker (and in flight in the engine)
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None  # adapters kept read in CPU memory; None: max_loras


@dataclass
class TrillmConfig:
    """Everything resolved: handed to the engine core and (as plain data) to every worker."""

    model: ModelConfig
    cache: CacheConfig
    scheduler: SchedulerConfig
    parallel: ParallelConfig
    device: str  # "cpu" | "cuda"
    seed: int = 0
    attention_backend: str = "torch"
    max_logprobs: int = 20
    # --enable-prompt-embeds: prompts may be input embeddings (trillm/engine/prompt_embeds.py)
    enable_prompt_embeds: bool = False
    reasoning_parser: str | None = None  # the engine core's structured outputs wait for it
    # structured_outputs_config: backend, engine-wide request defaults, enable_in_reasoning
    structured_outputs: StructuredOutputsConfig = field(default_factory=StructuredOutputsConfig)
    structured_outputs_cache_bytes: int = DEFAULT_GRAMMAR_CACHE_BYTES  # compiled grammars kept
    lora: LoRAConfig | None = None  # None: LoRA off (--enable-lora not given)
    pooler: PoolerConfig | None = None  # set: a pooling model (embeddings), no generation
    speculative: SpeculativeConfig | None = None  # speculative_config, parsed
    # speculative_config's draft_model: the draft (same tokenizer), run beside the target by
    # the worker (trillm/spec_decode/draft_model.py); None without one.
    draft_model: ModelConfig | None = None
    # No step programs (trillm/worker/step_program.py): every step runs the eager forward.
    enforce_eager: bool = False
    # vLLM's --enable-sleep-mode: sleep(level) / wake_up(tags) allowed (engine/core_control.py).
    enable_sleep_mode: bool = False
    # Most items of each modality per prompt (trillm/config/multimodal.py); empty: a text-only
    # model, which takes none.
    limit_mm_per_prompt: dict[str, int] = field(default_factory=dict)
    # Chat image URLs (trillm/engine/media.py): the directory file:// URLs may name ("": none),
    # the hosts http(s) URLs may name (None: any); the image processor's keywords for every
    # request (mm_processor_kwargs; a request's own win).
    allowed_local_media_path: str = ""
    allowed_media_domains: list[str] | None = None
    mm_processor_kwargs: dict[str, Any] = field(default_factory=dict)
    # GiB of processed images the frontend keeps (trillm/engine/mm_processor_cache.py); 0: none
    mm_processor_cache_gb: float = DEFAULT_MM_PROCESSOR_CACHE_GB
    # How message content reaches the chat template: "auto", "string" or "openai" (vLLM's)
    chat_template_content_format: str = "auto"
    # --logits-processors and the vllm.logits_processors plugins (config/logits_processors.py)
    logits_processors: list[LogitsProcessorSpec] = field(default_factory=list)
    # --kv-transfer-config: the KV connector (trillm/kv_transfer/); None: none
    kv_transfer: KVTransferConfig | None = None
    # --kv-offloading-size: the KV offload tier (trillm/kv_transfer/offload*.py); None: none
    kv_offload: KVOffloadConfig | None = None
    # --collect-detailed-traces (vLLM's ObservabilityConfig, config/observability.py): the ranks
    # time each step's model forward ("model") / execute call ("worker"), worker/step_timing.py
    collect_model_forward_time: bool = False
    collect_model_execute_time: bool = False
