"""Engine arguments (vLLM's names) and the resolved configuration they produce."""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field, fields
from typing import Any, Literal, TypeVar, get_args

from trillm.spec_decode.config import SpeculativeConfig

logger = logging.getLogger(__name__)

# The values of EngineArgs' enumerated fields, each spelled once: the tuples the checks use
# are derived from these (``get_args``).
Device = Literal["auto", "cpu", "cuda"]
AttentionBackendName = Literal["torch", "triton", "flashinfer", "eager"]
LoadFormat = Literal["auto", "safetensors", "gguf"]  # vLLM's names for what trillm reads
KVCacheDtype = Literal["auto", "bfloat16", "fp8", "fp8_e4m3"]
Convert = Literal["auto", "none", "embed", "classify"]
Numerics = Literal["fast", "transformers"]
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


# How an EngineArgs field is spelled on the command line: ``trillm serve`` and ``trillm bench
# latency|throughput`` add one flag per field from this (trillm/entrypoints/cli/engine_flags.py),
# its type from the annotation (int, float, str, bool: --x/--no-x, a Literal: its choices)
# unless ``value`` names one of the parsers in flag_types.py.
FlagValue = Literal[
    "positive_int",
    "non_negative_int",
    "positive_seconds",
    "memory_size",
    "grammar_cache_bytes",
    "json_object",
    "quantization",
    "kv_cache_dtype",
    "load_format",
    "speculative_config",
]


@dataclass(frozen=True)
class Flag:
    help: str
    aliases: tuple[str, ...] = ()  # short spellings, e.g. "-tp"
    value: FlagValue | None = None  # None: the annotation's type
    metavar: str | None = None
    several: bool = False  # nargs="+"; the field takes the first (served_model_name)


T = TypeVar("T")


def flag(default: T, help: str, **spec: Any) -> T:
    """An EngineArgs field that is an engine flag (``--`` + its name, dashed)."""
    return field(default=default, metadata={"flag": Flag(help, **spec)})


def not_a_flag(default: T, why: str) -> T:
    """An EngineArgs field that no engine flag sets, and why."""
    return field(default=default, metadata={"not_a_flag": why})


@dataclass
class EngineArgs:
    """What a user passes to ``trillm serve``, ``open_engine`` or ``LLM`` (vLLM's names).

    Each field's ``flag(default, help)`` is its command-line flag; ``not_a_flag`` says why not.
    """

    model: str | None = not_a_flag(
        None,  # None: the embedded default model
        "each command spells it: serve's MODEL or --model, bench's MODEL or --model",
    )
    tokenizer: str | None = flag(None, "Tokenizer folder, if not the model's.")
    served_model_name: str | None = flag(
        None,
        "Name(s) the API accepts as 'model'; the first is reported in responses. Default: the "
        "model path.",
        several=True,
    )
    revision: str | None = flag(None, "Hub revision of the model.")
    dtype: str = flag("auto", "auto, float32, bfloat16 or float16 (default: auto).")
    seed: int = flag(0, "Random seed of the engine (default: 0).")
    max_model_len: int | None = flag(None, "Context length (default: the model's).")
    block_size: int = flag(16, "Tokens per KV-cache block (default: 16).")
    max_num_seqs: int = flag(256, "Most requests in a batch (default: 256).")
    max_num_batched_tokens: int | None = flag(None, "Token budget of one step.")
    long_prefill_token_threshold: int = flag(
        0, "Most prefill tokens of one request in a step (default: 0, no cap but the budget)."
    )
    enable_prefix_caching: bool = flag(
        True, "Reuse KV blocks of shared prompt prefixes (default: on)."
    )
    scheduling_policy: Literal["fcfs", "priority"] = flag(
        "fcfs", "Waiting requests in arrival order, or by their priority (default: fcfs)."
    )
    tensor_parallel_size: int = flag(
        1,
        "Tensor-parallel ranks: one worker process each, joined by torch.distributed (default: 1).",
        aliases=("-tp",),
        value="positive_int",
    )
    # Engine cores behind the one frontend, each with its own scheduler, KV cache and workers
    # (trillm/engine/dp_router.py routes requests among them).
    data_parallel_size: int = flag(
        1,
        "Engine cores behind the one HTTP server, each with its own scheduler, KV cache "
        "and workers; each request goes to the least-loaded one, or to the one that last "
        "took its prompt's first block (default: 1).",
        aliases=("-dp",),
        value="positive_int",
    )
    pipeline_parallel_size: int = flag(
        1,
        "Pipeline stages: the layers split evenly over them, hidden states passed stage "
        "to stage by torch.distributed; tensor x pipeline worker processes (default: 1).",
        aliases=("-pp",),
        value="positive_int",
    )
    kv_cache_memory: int | str | None = flag(
        None,
        "KV-cache budget on CPU, e.g. 2GiB or 512MiB (default: 1GiB).",
        value="memory_size",
    )
    gpu_memory_utilization: float = flag(
        0.9, "Fraction of GPU memory for weights and KV cache (default: 0.9)."
    )
    num_gpu_blocks_override: int | None = flag(None, "Force the KV block count.")
    max_logprobs: int = flag(
        20, "Most logprobs / top_logprobs a request may ask for (default: 20)."
    )
    # Streamed (DELTA) outputs wake their reader every N tokens (first token and finish at
    # once): fewer, larger chunks under load (vLLM's --stream-interval).
    stream_interval: int = flag(
        1,
        "Streamed responses send a chunk every N tokens; the first token and the end "
        "go at once (default: 1).",
    )
    device: Device = flag("auto", "Where the model runs (default: auto).")
    attention_backend: AttentionBackendName | None = flag(
        None,  # None: the best available
        "torch, triton, flashinfer or eager (transformers' eager attention, one request "
        "at a time, CPU) (default: best).",
    )
    distributed_executor_backend: Literal["mp", "uni"] = flag(
        "mp", "mp: a worker process per rank; uni: one rank in this process (default: mp)."
    )
    generation_config: str = flag(
        "auto",
        "'auto' (the model's generation_config.json gives request defaults), 'vllm' "
        "(ignore it) or a folder path.",
    )
    trust_remote_code: bool = flag(
        False,
        "The checkpoint's tokenizer code may run; its model code never does (trillm's own "
        "model implementations are used).",
    )
    enforce_eager: bool = flag(
        False,
        "Run small CPU decode steps eagerly: no step-program replay (trillm's "
        "counterpart of CUDA graphs).",
    )
    chat_template: str | None = flag(None, "Chat template: a Jinja file path or the template.")
    skip_tokenizer_init: bool = flag(
        False,
        "Not supported (refused): the engine needs the tokenizer (stop strings, "
        "detokenization, chat templates).",
    )
    # vLLM's structured-outputs reasoning_parser; the server also separates reasoning_content
    # by it.
    reasoning_parser: str | None = flag(
        None,
        "Separate the <think> section into reasoning_content: deepseek_r1 or qwen3; "
        "structured outputs then constrain only the output after </think>.",
        metavar="NAME",
    )
    # Bytes of compiled grammars kept for reuse (LRU); one grammar may take 1/4 of it. A size
    # like "512MiB" or a byte count. None: vLLM's VLLM_XGRAMMAR_CACHE_MB (MiB) when set, else
    # 512 MiB, vLLM's default.
    structured_outputs_cache_bytes: int | str | None = flag(
        None,
        "Memory for compiled grammars (JSON schemas, regexes, ...) kept for reuse, e.g. "
        "512MiB or a byte count; least recently used out. One grammar may take 1/4 of it: a "
        f"larger one is refused (400) (default: {DEFAULT_GRAMMAR_CACHE_BYTES >> 20}MiB).",
        value="grammar_cache_bytes",
        metavar="SIZE",
    )
    # Weight-only quantization (vLLM's method names): "fp8" (dynamic, CPU: quantized at load);
    # "gguf" (implied by a .gguf model: its Q4_0/Q4_1/Q8_0/K-quant weights stay quantized); "awq" /
    # "gptq" (the checkpoint's own 4-bit method, CPU; implied by it). None: none.
    quantization: str | None = flag(
        None,
        "fp8: linear weights quantized to fp8 e4m3 at load, a scale per output channel "
        "(CPU); gguf: a .gguf model's Q4_0/Q4_1/Q8_0/Q2_K..Q6_K weights stay quantized (the "
        "default for a GGUF model); awq / gptq: the checkpoint's own 4-bit method (CPU; implied "
        "by the checkpoint, refused when it names another); vLLM's other methods are not "
        "implemented yet: refused.",
        aliases=("-q",),
        value="quantization",
    )
    # LoRA adapters (trillm/lora/): requests may name one; at most max_loras in flight at once.
    enable_lora: bool = flag(False, "Serve LoRA adapters (PEFT folders).")
    max_loras: int = flag(
        1,
        "Adapters in flight (and resident on the worker) at once (default: 1).",
        value="positive_int",
    )
    max_lora_rank: int = flag(
        16, "Highest adapter rank accepted (default: 16).", value="positive_int"
    )
    load_format: LoadFormat = flag(  # (model_executor/gguf_loader.py)
        "auto",
        "auto, safetensors or gguf (a .gguf model; auto picks it too); others are refused.",
        value="load_format",
    )
    # trillm's: load a GGUF's quantized tensors dequantized to the run's dtype instead.
    dequantize_gguf: bool = flag(
        False,
        "A .gguf model's quantized tensors (Q4_0/Q4_1/Q8_0, Q2_K..Q6_K) are dequantized to "
        "--dtype at load (default: kept quantized, multiplied by a native CPU kernel).",
    )
    # KV cache storage (vLLM's names): auto (the model's dtype), bfloat16, fp8 / fp8_e4m3 (CPU).
    kv_cache_dtype: KVCacheDtype = flag(
        "auto",
        "auto (the model's dtype), bfloat16, fp8 / fp8_e4m3 (e4m3, scale 1.0; CPU). "
        "Others are not implemented yet: refused.",
        value="kv_cache_dtype",
    )
    # vLLM's runner / convert: "pooling" (or convert="embed") serves embeddings instead of
    # generating (``trillm.model_executor.pooling``); "auto" / "generate": generation.
    runner: str = flag(
        "auto",
        "vLLM's runner: auto | generate | pooling (embeddings: /v1/embeddings, /pooling); "
        "or a model runner as module:Class, e.g. trillm.worker.fake_runner:FakeModelRunner "
        "(a near-zero-cost model for measuring serving overhead).",
    )
    convert: Convert = flag(
        "auto",
        "embed: serve a generative checkpoint as an embedding model (= --runner pooling); "
        "classify: a *ForSequenceClassification checkpoint's classifier (/classify; the default "
        "for such a checkpoint).",
    )
    # vLLM's PoolerConfig fields: {"pooling_type": "LAST" | "MEAN" | "CLS", "normalize": bool};
    # None: the model folder's sentence-transformers config, else LAST + normalize.
    pooler_config: dict[str, Any] | None = flag(
        None,
        'Pooling of a pooling model, JSON: {"pooling_type": "LAST"|"MEAN"|"CLS", '
        '"normalize": true|false} (default: the folder\'s sentence-transformers config, else '
        "LAST + normalize).",
        value="json_object",
    )
    # vLLM's JSON shape: {"method": "ngram", "num_speculative_tokens": k,
    # "prompt_lookup_min": a, "prompt_lookup_max": b} (a dict, or that JSON as a string).
    speculative_config: dict[str, Any] | str | None = flag(
        None,
        'Speculative decoding, e.g. \'{"method": "ngram", "num_speculative_tokens": 4, '
        '"prompt_lookup_min": 2, "prompt_lookup_max": 4}\' or \'{"method": "draft_model", '
        '"model": PATH, "num_speculative_tokens": 4}\' (a smaller model with the same '
        "tokenizer); eagle / medusa / mtp are not implemented yet: refused.",
        value="speculative_config",
        metavar="JSON",
    )
    # Ranks on several machines (torchrun's names): node 0 runs the engine and its share of
    # the ranks; ``trillm serve --headless --node-rank k`` runs node k's share. The
    # torch.distributed TCP rendezvous is at master_addr:master_port (node 0's address).
    nnodes: int = flag(
        1,
        "Machines the ranks (tensor x pipeline parallel) run on; each runs "
        "tensor_parallel_size x pipeline_parallel_size / nnodes of them (default: 1).",
        value="positive_int",
    )
    node_rank: int = flag(
        0,
        "This machine's index: 0 serves HTTP and runs the engine; others run with "
        "--headless (default: 0).",
        value="non_negative_int",
    )
    master_addr: str = flag(
        "127.0.0.1",
        "Node 0's address, where the torch.distributed TCP rendezvous is (default: "
        "127.0.0.1). Across machines gloo picks the interface of the host name, or "
        "GLOO_SOCKET_IFNAME.",
    )
    master_port: int | None = flag(  # None: a free loopback port (one node), 29500 (several)
        None,
        "The rendezvous port on node 0 (default: 29500 with --nnodes > 1; a free "
        "loopback port on one node).",
        value="positive_int",
    )
    # A collective that waits longer means a rank stopped answering (vLLM's name); None: 120 s.
    distributed_timeout_seconds: float | None = flag(
        None,
        "A torch.distributed collective (or the rendezvous) that waits longer means a "
        "rank stopped answering: the engine stops and names it (default: 120).",
        value="positive_seconds",
    )
    # trillm's: "fast" (the native kernels) or "transformers" (every op as transformers' eager
    # forward computes it: trillm/model_executor/transformers_numerics.py).
    numerics: Numerics = flag(
        "fast",
        "fast: trillm's native kernels (default). transformers: every op as transformers' "
        "eager forward computes it (torch's F.linear and RMSNorm, eager attention one request "
        "at a time): a request's output equals transformers' own to the bit in bf16 where "
        "torch's GEMM is batch-invariant (checked at load; fp32: to rounding); Llama-family "
        "models on CPU; slower.",
    )

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
NUMERICS: tuple[str, ...] = get_args(Numerics)


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
