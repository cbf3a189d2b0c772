"""``EngineArgs``: what a user passes to ``trillm serve``, ``open_engine`` or ``LLM`` (vLLM's
names), each field with its flag, checked when made (``engine_checks.py``; the parallel
world's checks in ``parallel.py``)."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Literal

from trillm.config.engine_checks import check_engine_args
from trillm.config.mm_processor_cache import DEFAULT_MM_PROCESSOR_CACHE_GB
from trillm.config.values import (
    DEFAULT_GRAMMAR_CACHE_BYTES,
    AttentionBackendName,
    Convert,
    Device,
    KVCacheDtype,
    LoadFormat,
    Numerics,
    flag,
    not_a_flag,
)


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
    max_num_seqs: int | None = flag(None, "Most requests in a batch (vLLM's default, <= budget).")
    max_num_batched_tokens: int | None = flag(None, "Step budget >= max_num_seqs (vLLM's default).")
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
    enable_expert_parallel: bool = flag(
        False,
        "MoE experts placed whole over the tensor-parallel ranks, tokens sent to them by "
        "all-to-all (default: off: each expert split over the ranks).",
        aliases=("-ep",),
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
    distributed_executor_backend: Literal["mp", "uni", "ray"] = flag(
        "mp",
        "mp: a worker process per rank; uni: one rank in this process; ray: a Ray actor per "
        "rank (trillm[ray]) (default: mp).",
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
    # vLLM's sleep mode (trillm/engine/core_control.py): LLM.sleep / wake_up, /sleep, /wake_up.
    enable_sleep_mode: bool = flag(
        False,
        "Allow sleep(level=1|2) / wake_up(): level 1 frees the KV cache (weights kept), "
        "level 2 also drops the weights and reloads them from disk at wake-up.",
    )
    chat_template: str | None = flag(None, "Chat template: a Jinja file path or the template.")
    # vLLM's: how message content reaches the chat template (trillm/engine/chat_template.py)
    chat_template_content_format: Literal["auto", "string", "openai"] = flag(
        "auto",
        "How message content reaches the chat template: string (the parts' text joined by "
        "newlines), openai (the list of parts, an image as {'type': 'image'}), auto (openai "
        "when the template loops over a message's content, else string).",
    )
    # vLLM's: /v1/completions' prompt_embeds and LLM.generate({"prompt_embeds": tensor})
    enable_prompt_embeds: bool = flag(
        False,
        "Accept prompts given as input embeddings [num_tokens, hidden_size] (prompt_embeds: "
        "a base64 torch.save'd tensor over HTTP) instead of tokens.",
    )
    skip_tokenizer_init: bool = flag(
        False,
        "Load no tokenizer: token-id prompts, token-id outputs with empty text; text "
        "prompts, chats, stop strings, bad words, structured outputs refused.",
    )
    # vLLM's structured-outputs reasoning_parser; the server also separates reasoning_content
    # by it.
    reasoning_parser: str | None = flag(
        None,
        "Separate the reasoning section into reasoning_content (vLLM's names): deepseek_r1, "
        "deepseek_v3, qwen3, glm45, step3, kimi_k2, mistral, hunyuan_a13b, granite, "
        "openai_gptoss; structured outputs then constrain only the output after it.",
        metavar="NAME",
    )
    # vLLM's engine-wide structured-outputs settings (trillm/config/structured_outputs.py):
    # backend, whitespace and additionalProperties defaults, the reasoning parser and its
    # plugin, constraining inside the reasoning.
    structured_outputs_config: dict[str, Any] | None = flag(
        None,
        'Structured outputs for every request, e.g. \'{"backend": "xgrammar", '
        '"disable_any_whitespace": true}\' (or --structured-outputs-config.KEY VALUE): '
        "backend auto/xgrammar/guidance/outlines/lm-format-enforcer (all compiled by xgrammar; "
        "grammars only as xgrammar's EBNF), disable_fallback, disable_any_whitespace, "
        "disable_additional_properties, reasoning_parser, reasoning_parser_plugin, "
        "enable_in_reasoning.",
        value="json_object",
        metavar="JSON",
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
    max_cpu_loras: int | None = flag(
        None,
        "Adapters kept read in CPU memory, at least --max-loras (default: --max-loras); one "
        "asked for again after its slot was taken is not read from disk again.",
        value="positive_int",
    )
    load_format: LoadFormat = flag(  # (model_executor/gguf_loader.py)
        "auto",
        "auto, safetensors, gguf (a .gguf model; auto picks it too) or dummy (no weights "
        "read: random values in the checkpoint's shapes, for benchmarks); others are refused.",
        value="load_format",
    )
    # vLLM's: keys laid over config.json before anything reads it (a nested object merges
    # into the sub-config of its name, e.g. text_config).
    hf_overrides: dict[str, Any] | None = flag(
        None,
        "Fields laid over the model's config.json, e.g. '{\"rope_theta\": 500000}' (nested "
        "objects merge into sub-configs).",
        value="json_object",
        metavar="JSON",
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
    # vLLM's KVTransferConfig (trillm/kv_transfer/): the shared-storage connector only.
    kv_transfer_config: dict[str, Any] | None = flag(
        None,
        'KV connector, e.g. \'{"kv_connector": "SharedStorageConnector", "kv_role": '
        '"kv_both", "kv_connector_extra_config": {"shared_storage_path": DIR}}\': producers '
        "(kv_producer, kv_both) save prompts' KV blocks to DIR, consumers (kv_consumer, "
        "kv_both) load them instead of computing them; other connectors are refused.",
        value="json_object",
        metavar="JSON",
    )
    kv_offloading_size: float | None = flag(None, "GiB of KV offload tier, LRU (default: none).")
    kv_offloading_backend: Literal["native", "lmcache"] = flag(
        "native", "native: host memory beside the KV cache (default); lmcache: refused."
    )
    # vLLM's JSON shape: {"method": "ngram", "num_speculative_tokens": k,
    # "prompt_lookup_min": a, "prompt_lookup_max": b} (a dict, or that JSON as a string).
    speculative_config: dict[str, Any] | str | None = flag(
        None,
        'Speculative decoding, e.g. \'{"method": "ngram", "num_speculative_tokens": 4, '
        '"prompt_lookup_min": 2, "prompt_lookup_max": 4}\' or \'{"method": "draft_model", '
        '"model": PATH, "num_speculative_tokens": 4}\' (a smaller model with the same '
        'tokenizer) or \'{"method": "eagle3", "model": HEAD, "num_speculative_tokens": '
        "3}' (an EAGLE / EAGLE-3 head, method eagle or eagle3); medusa / mtp are not "
        "implemented yet: refused.",
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
    # vLLM's: the most items of each modality one prompt may carry, {"image": N}; None: 1 per
    # modality the model takes (trillm/config/multimodal.py). 0 disables a modality.
    limit_mm_per_prompt: dict[str, int] | None = flag(
        None,
        "Most multimodal items per prompt, e.g. '{\"image\": 2}' (default: 1 of each "
        "modality the model takes; 0 disables it); a modality the model does not take is "
        "refused.",
        value="limit_mm_per_prompt",
        metavar="JSON",
    )
    # vLLM's: where chat image URLs may come from (trillm/engine/media.py), and the image
    # processor's keywords for every request.
    allowed_local_media_path: str = flag(
        "", "Directory file:// image URLs may read from (default: none; file:// refused)."
    )
    allowed_media_domains: list[str] | None = flag(
        None, "Hosts http(s) image URLs may name (default: any).", value="host", several=True
    )
    mm_processor_kwargs: dict[str, Any] | None = flag(
        None, "The image processor's keywords, e.g. '{\"do_normalize\": false}'.",
        value="json_object", metavar="JSON",
    )  # fmt: skip
    # vLLM's: the frontend's cache of processed images (trillm/engine/mm_processor_cache.py)
    mm_processor_cache_gb: float = flag(
        DEFAULT_MM_PROCESSOR_CACHE_GB,
        "GiB of processed images kept, so an image sent again skips the image processor "
        "(default: 4; 0 disables the cache).",
        metavar="GiB",
    )
    # vLLM's: skip the encoder's share of the start-up memory profile. trillm runs no
    # profiling forward at start (the KV cache is sized from the budget), so it is moot.
    skip_mm_profiling: bool = flag(
        False,
        "Accepted: trillm runs no memory-profiling pass at start, for the encoder or "
        "otherwise (said once in the log).",
    )
    # vLLM's custom logits processors, classes or names (trillm/config/logits_processors.py)
    logits_processors: list[Any] | None = flag(
        None,
        "Custom logits processors (vLLM's LogitsProcessor interface), as pkg.module:ClassName "
        "or pkg.module.ClassName; applied to every request, which turn them on through "
        "extra_args (vllm_xargs over HTTP). Plugins of the vllm.logits_processors entry-point "
        "group are always loaded.",
        several=True,
        value="class_name",
        metavar="CLASS",
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
        check_engine_args(self)  # honour or refuse, before anything loads

    @classmethod
    def from_kwargs(cls, model: str | None = None, **kwargs: Any) -> EngineArgs:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise TypeError(f"Unknown engine argument(s): {', '.join(unknown)}")
        return cls(model=model, **kwargs)
