"""Samples of ``trillm serve`` engine flags: each flag with a value, the EngineArgs field it
sets and the value expected there (tests/entrypoints/test_field_effects_engine.py)."""

# flag -> (value given, EngineArgs field, value expected there)
SERVE_FLAG_SAMPLES = {
    "--tokenizer": ("/tok", "tokenizer", "/tok"),
    "--revision": ("v2", "revision", "v2"),
    "--dtype": ("float32", "dtype", "float32"),
    "--seed": ("3", "seed", 3),
    "--max-model-len": ("128", "max_model_len", 128),
    "--block-size": ("32", "block_size", 32),
    "--max-num-seqs": ("5", "max_num_seqs", 5),
    "--max-num-batched-tokens": ("64", "max_num_batched_tokens", 64),
    "--long-prefill-token-threshold": ("9", "long_prefill_token_threshold", 9),
    "--no-enable-prefix-caching": (None, "enable_prefix_caching", False),
    "--enable-prefix-caching": (None, "enable_prefix_caching", True),
    "--scheduling-policy": ("priority", "scheduling_policy", "priority"),
    "--tensor-parallel-size": ("1", "tensor_parallel_size", 1),
    "--kv-cache-memory": ("2GiB", "kv_cache_memory", 2 << 30),
    "--gpu-memory-utilization": ("0.5", "gpu_memory_utilization", 0.5),
    "--num-gpu-blocks-override": ("12", "num_gpu_blocks_override", 12),
    "--max-logprobs": ("4", "max_logprobs", 4),
    "--stream-interval": ("3", "stream_interval", 3),
    "--device": ("cpu", "device", "cpu"),
    "--attention-backend": ("torch", "attention_backend", "torch"),
    "--distributed-executor-backend": ("uni", "distributed_executor_backend", "uni"),
    "--generation-config": ("vllm", "generation_config", "vllm"),
    "--trust-remote-code": (None, "trust_remote_code", True),
    "--runner": ("pkg.mod:Cls", "runner", "pkg.mod:Cls"),  # open_engine's runner argument
    "--served-model-name": ("alias", "served_model_name", "alias"),
    "--quantization": ("fp8", "quantization", "fp8"),
    "--kv-cache-dtype": ("fp8_e4m3", "kv_cache_dtype", "fp8_e4m3"),
}
