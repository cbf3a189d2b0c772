"""Engine arguments (vLLM's names) and the resolved configuration they produce."""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field, fields
from typing import Any, Literal, get_args

from trillm.spec_decode.config import SpeculativeConfig

logger = logging.getLogger(__name__)

# The values of EngineArgs' enumerated fields, each spelled once: the tuples the checks use
# are derived from these (``get_args``).
Device = Literal["auto", "cpu", "cuda"]
AttentionBackendName = Literal["torch", "triton", "flashinfer", "eager"]
LoadFormat = Literal["auto", "safetensors", "gguf"]  # vLLM's names for what trillm reads
KVCacheDtype = Literal["auto", "bfloat16", "fp8", "fp8_e4m3"]
Convert = Literal["auto", "none", "embed", "classify"]
DEVICES: tuple[str, ...] = get_args(Device)
ATTENTION_BACKENDS: tuple[str, ...] = get_args(AttentionBackendName)
LOAD_FORMATS: tuple[str, ...] = get_args(LoadFormat)

DEFAULT_KV_CACHE_MEMORY = 1 << 30  # CPU: 1 GiB unless --kv-cache-memory says otherwise
# Compiled grammars kept for reuse: vLLM's xgrammar cache default (VLLM_XGRAMMAR_CACHE_MB=512).
DEFAULT_GRAMMAR_CACHE_BYTES = 512 << 20
GRAMMAR_CACHE_ENV = "VLLM_XGRAMMAR_CACHE_MB"  # (trillm/envs.py reads it)


def parse_memory_size(value: str | int | float) -> int:
    """'2GiB', '512MB', '1e9' or a byte count -> bytes."""
    if isinstance(value, (int, float)):
        return int(value)
    m = re.fullmatch(r"\s*([0-9.eE+]+)\s*([KMGT]?)(i?)B?\s*", value, re.IGNORECASE)
    if not m:
        raise ValueError(f"Cannot parse memory size {value!r}; use e.g. 2GiB, 512MiB or bytes.")
    number, unit, binary = float(m.group(1)), m.group(2).upper(), m.group(3)
    base = 1024 if binary or unit == "" else 1000
    power = " KMGT".index(unit) if unit else 0
    return int(number * base**power)


@dataclass
class EngineArgs:
    """What a user passes to ``trillm serve``, ``open_engine`` or ``LLM`` (vLLM's names)."""

    model: str | None = None  # None: the embedded default model
    tokenizer: str | None = None
    served_model_name: str | None = None
    revision: str | None = None
    dtype: str = "auto"
    seed: int = 0
    max_model_len: int | None = None
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    long_prefill_token_threshold: int = 0
    enable_prefix_caching: bool = True
    scheduling_policy: Literal["fcfs", "priority"] = "fcfs"
    tensor_parallel_size: int = 1
    # Engine cores behind the one frontend, each with its own scheduler, KV cache and workers
    # (trillm/engine/dp_router.py routes requests among them).
    data_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    kv_cache_memory: int | str | None = None  # CPU budget for the KV cache
    gpu_memory_utilization: float = 0.9
    num_gpu_blocks_override: int | None = None
    max_logprobs: int = 20
    # Streamed (DELTA) outputs wake their reader every N tokens (first token and finish at
    # once): fewer, larger chunks under load (vLLM's --stream-interval).
    stream_interval: int = 1
    device: Device = "auto"
    attention_backend: AttentionBackendName | None = None  # None: the best available
    distributed_executor_backend: Literal["mp", "uni"] = "mp"
    generation_config: str = "auto"  # auto (from the model folder) | vllm (ignore it) | a path
    trust_remote_code: bool = False
    # True: no step-program replay of small CPU decode steps (vLLM: no CUDA graphs).
    enforce_eager: bool = False
    chat_template: str | None = None
    skip_tokenizer_init: bool = False
    # deepseek_r1 | qwen3: structured outputs constrain only after </think> (vLLM's
    # structured-outputs reasoning_parser; the server's --reasoning-parser sets it too).
    reasoning_parser: str | None = None
    # Bytes of compiled grammars kept for reuse (LRU); one grammar may take 1/4 of it. A size
    # like "512MiB" or a byte count. None: vLLM's VLLM_XGRAMMAR_CACHE_MB (MiB) when set, else
    # 512 MiB, vLLM's default.
    structured_outputs_cache_bytes: int | str | None = None
    # Weight-only quantization (vLLM's method names): "fp8" (dynamic, CPU: quantized at load);
    # "gguf" (implied by a .gguf model: its Q4_0/Q4_1/Q8_0/K-quant weights stay quantized); "awq" /
    # "gptq" (the checkpoint's own 4-bit method, CPU; implied by it). None: none.
    quantization: str | None = None
    # LoRA adapters (trillm/lora/): requests may name one; at most max_loras in flight at once.
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    load_format: LoadFormat = "auto"  # (model_executor/gguf_loader.py)
    # trillm's: load a GGUF's quantized tensors dequantized to the run's dtype instead.
    dequantize_gguf: bool = False
    # KV cache storage (vLLM's names): auto (the model's dtype), bfloat16, fp8 / fp8_e4m3 (CPU).
    kv_cache_dtype: KVCacheDtype = "auto"
    # vLLM's runner / convert: "pooling" (or convert="embed") serves embeddings instead of
    # generating (``trillm.model_executor.pooling``); "auto" / "generate": generation.
    runner: str = "auto"
    convert: Convert = "auto"
    # vLLM's PoolerConfig fields: {"pooling_type": "LAST" | "MEAN" | "CLS", "normalize": bool};
    # None: the model folder's sentence-transformers config, else LAST + normalize.
    pooler_config: dict[str, Any] | None = None
    # vLLM's JSON shape: {"method": "ngram", "num_speculative_tokens": k,
    # "prompt_lookup_min": a, "prompt_lookup_max": b} (a dict, or that JSON as a string).
    speculative_config: dict[str, Any] | str | None = None
    # Ranks on several machines (torchrun's names): node 0 runs the engine and its share of
    # the ranks; ``trillm serve --headless --node-rank k`` runs node k's share. The
    # torch.distributed TCP rendezvous is at master_addr:master_port (node 0's address).
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int | None = None  # None: a free loopback port (one node), 29500 (several)
    # A collective that waits longer means a rank stopped answering (vLLM's name); None: 120 s.
    distributed_timeout_seconds: float | None = None
    # trillm's: "fast" (the native kernels) or "transformers" (every op as transformers' eager
    # forward computes it: trillm/model_executor/transformers_numerics.py).
    numerics: str = "fast"

    def __post_init__(self) -> None:
        # Honour or refuse: what trillm cannot do yet is refused before anything loads.
        for name in ("max_loras", "max_lora_rank"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}.")
        for name in ("tensor_parallel_size", "data_parallel_size", "pipeline_parallel_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}.")
        for name in ("tensor_parallel_size", "pipeline_parallel_size"):
            if getattr(self, name) > 1 and self.distributed_executor_backend == "uni":
                raise ValueError(
                    f"{name} > 1 needs distributed_executor_backend='mp' (one worker "
                    "process per rank); 'uni' runs one rank in this process."
                )
        check_nodes(self)
        if self.skip_tokenizer_init:
            raise ValueError(
                "skip_tokenizer_init is not supported: the engine needs the tokenizer "
                "(stop strings, detokenization, chat templates)."
            )
        if self.reasoning_parser is not None:
            from trillm.parsers.reasoning import get_reasoning_parser

            get_reasoning_parser(self.reasoning_parser)  # ValueError naming the known ones
        if self.quantization is not None:
            from trillm.model_executor.quantization import check_quantization

            check_quantization(self.quantization)  # ValueError naming the method
        check_kv_cache_dtype(self.kv_cache_dtype)
        self.structured_outputs_cache_bytes = (
            grammar_cache_bytes_from_env()
            if self.structured_outputs_cache_bytes is None
            else check_grammar_cache_bytes(self.structured_outputs_cache_bytes)
        )
        check_numerics(self.numerics)
        check_runner(self.runner, self.convert, self.pooler_config)  # ValueError naming it
        from trillm.spec_decode.config import parse_speculative_config

        parse_speculative_config(self.speculative_config)  # ValueError naming the key
        # Accepted with vLLM's meaning where nothing here differs; said once in the log.
        if self.trust_remote_code:
            logger.info(
                "trust_remote_code: the checkpoint's tokenizer code may run; its model "
                "code never does (trillm's own model implementations are used)."
            )

    @classmethod
    def from_kwargs(cls, model: str | None = None, **kwargs: Any) -> EngineArgs:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise TypeError(f"Unknown engine argument(s): {', '.join(unknown)}")
        return cls(model=model, **kwargs)


DEFAULT_MASTER_PORT = 29500  # torchrun's


def check_nodes(args: EngineArgs) -> None:
    """Refuse node settings that cannot form the world: ValueError naming the field."""
    nnodes, node_rank = args.nnodes, args.node_rank
    tp, pp = args.tensor_parallel_size, args.pipeline_parallel_size
    if isinstance(nnodes, bool) or not isinstance(nnodes, int) or nnodes < 1:
        raise ValueError(f"nnodes must be an integer >= 1, got {nnodes!r}.")
    if isinstance(node_rank, bool) or not isinstance(node_rank, int) or not 0 <= node_rank < nnodes:
        raise ValueError(
            f"node_rank must be an integer in [0, nnodes={nnodes}), got {node_rank!r}."
        )
    if (tp * pp) % nnodes:
        raise ValueError(
            f"nnodes={nnodes} must divide tensor_parallel_size={tp} x pipeline_parallel_size="
            f"{pp} (each node runs tensor_parallel_size x pipeline_parallel_size / nnodes ranks)."
        )
    if nnodes > 1 and args.distributed_executor_backend != "mp":
        raise ValueError("nnodes > 1 needs distributed_executor_backend='mp'.")
    if args.data_parallel_size > 1 and (nnodes > 1 or args.master_port is not None):
        raise ValueError(
            "data_parallel_size > 1 with nnodes > 1 or a master_port is not implemented yet"
            ": each engine core's ranks meet at a loopback port of their own."
        )
    port = args.master_port
    if port is not None and (
        isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536
    ):
        raise ValueError(f"master_port must be a TCP port in [1, 65535], got {port!r}.")
    timeout = args.distributed_timeout_seconds
    if timeout is not None and (
        isinstance(timeout, bool)
        or not isinstance(timeout, (int, float))
        or not 0 < timeout < float("inf")
    ):
        raise ValueError(f"distributed_timeout_seconds must be a number > 0, got {timeout!r}.")


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


KV_CACHE_DTYPES: tuple[str, ...] = get_args(KVCacheDtype)
NUMERICS = ("fast", "transformers")


def check_numerics(name: object) -> str:
    """``name`` if it is one of ``NUMERICS``, else a ValueError naming it."""
    if name not in NUMERICS:
        raise ValueError(f"numerics must be one of {', '.join(NUMERICS)}; got {name!r}.")
    return str(name)


def grammar_cache_bytes_from_env() -> int:
    """vLLM's ``VLLM_XGRAMMAR_CACHE_MB`` (a positive whole number of MiB), else 512 MiB; a
    value that is not such a number is a ValueError naming the variable."""
    from trillm import envs

    mib = envs.XGRAMMAR_CACHE_MB.get()
    return DEFAULT_GRAMMAR_CACHE_BYTES if mib is None else mib << 20


def check_grammar_cache_bytes(value: object) -> int:
    """A positive byte count (or a size such as "512MiB"), else a ValueError naming it."""
    try:
        size = parse_memory_size(value) if isinstance(value, str | int | float) else 0
    except (ValueError, OverflowError):
        size = 0
    if isinstance(value, bool) or size < 1:
        raise ValueError(
            "structured_outputs_cache_bytes must be a size > 0 such as 512MiB or a byte "
            f"count; got {value!r}."
        )
    return size


def check_kv_cache_dtype(name: str) -> str:
    """``name`` if trillm stores a KV cache in it, else a ValueError naming it."""
    if name not in KV_CACHE_DTYPES:
        raise ValueError(
            f"kv_cache_dtype {name!r} is not implemented yet; choose one of "
            f"{', '.join(KV_CACHE_DTYPES)}."
        )
    return name


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
    distributed_executor_backend: Literal["mp", "uni"] = "mp"
    master_port: int = 0  # the ranks' TCP rendezvous (0: the executor picks a loopback port)
    collective_timeout_s: float = COLLECTIVE_TIMEOUT_S
    data_parallel_size: int = 1  # engine cores (each gets its own copy of the config)
    data_parallel_rank: int = 0  # which engine core this config's workers serve
    nnodes: int = 1  # node k runs ranks [k * L, (k + 1) * L), L = ranks_per_node
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    pipeline_parallel_size: int = 1  # stages; world = tensor x pipeline ranks

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

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


RUNNERS = ("auto", "generate", "pooling")
CONVERTS: tuple[str, ...] = get_args(Convert)
POOLING_TYPES = ("LAST", "MEAN", "CLS")


class PoolingConfigError(ValueError):
    """A runner / convert / pooler setting trillm cannot honour."""


@dataclass
class PoolerConfig:
    """How a pooling model turns a prompt's hidden states into one vector
    (``trillm/model_executor/pooling.py``)."""

    pooling_type: Literal["LAST", "MEAN", "CLS"] = "LAST"
    normalize: bool = True
    matryoshka: bool = False  # the model may be truncated to fewer ``dimensions``
    # "classify": a *ForSequenceClassification model (model_executor/classification.py): the
    # pooled LAST row through its score head, softmax over ``labels``
    task: Literal["embed", "classify"] = "embed"
    labels: list[str] = field(default_factory=list)

    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> PoolerConfig:
        """vLLM's ``pooler_config`` keys that trillm honours; others are refused."""
        unknown = set(cfg) - {"pooling_type", "normalize"}
        if unknown:
            raise PoolingConfigError(
                f"pooler_config: unsupported key(s) {sorted(unknown)}; "
                "supported: pooling_type, normalize."
            )
        kind = str(cfg.get("pooling_type", "LAST")).upper()
        if kind not in POOLING_TYPES:
            raise PoolingConfigError(
                f"pooler_config.pooling_type must be one of "
                f"{', '.join(POOLING_TYPES)}, got {kind!r}."
            )
        normalize = cfg.get("normalize", True)
        if not isinstance(normalize, bool):
            raise PoolingConfigError(
                f"pooler_config.normalize must be true or false, got {normalize!r}."
            )
        return cls(pooling_type=kind, normalize=normalize)  # type: ignore[arg-type]


def check_runner(runner: str, convert: str, pooler_config: dict[str, Any] | None) -> None:
    if runner not in RUNNERS:
        extra = " ('draft' models are part of speculative decoding)" if runner == "draft" else ""
        raise PoolingConfigError(
            f"runner must be one of {', '.join(RUNNERS)}, got {runner!r}{extra}."
        )
    if convert not in CONVERTS:
        raise PoolingConfigError(
            f"convert must be one of {', '.join(CONVERTS)} (reward models are not "
            f"implemented), got {convert!r}."
        )
    if runner == "generate" and convert in ("embed", "classify"):
        raise PoolingConfigError(
            f"convert={convert!r} makes a pooling model: it contradicts runner='generate'."
        )
    if pooler_config is not None:
        if not isinstance(pooler_config, dict):
            raise PoolingConfigError("pooler_config must be a JSON object.")
        PoolerConfig.from_dict(pooler_config)


def is_pooling(runner: str, convert: str) -> bool:
    return runner == "pooling" or convert in ("embed", "classify")


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
    reasoning_parser: str | None = None  # the engine core's structured outputs wait for it
    structured_outputs_cache_bytes: int = DEFAULT_GRAMMAR_CACHE_BYTES  # compiled grammars kept
    lora: LoRAConfig | None = None  # None: LoRA off (--enable-lora not given)
    pooler: PoolerConfig | None = None  # set: a pooling model (embeddings), no generation
    speculative: SpeculativeConfig | None = None  # speculative_config, parsed
    # speculative_config's draft_model: the draft (same tokenizer), run beside the target by
    # the worker (trillm/spec_decode/draft_model.py); None without one.
    draft_model: ModelConfig | None = None
    # No step programs (trillm/worker/step_program.py): every step runs the eager forward.
    enforce_eager: bool = False
