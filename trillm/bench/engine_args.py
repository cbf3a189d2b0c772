"""Engine flags shared by ``trillm serve`` and ``trillm bench latency|throughput``.

``add_engine_args(parser)`` adds one flag per ``trillm.config.EngineArgs`` field (vLLM's
names); ``engine_args_from_namespace(args)`` builds the ``EngineArgs``. Flags the user did not
give stay ``None`` in the namespace, so ``EngineArgs``' own defaults remain the only defaults.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import fields
from typing import Any

from trillm.config import EngineArgs, parse_memory_size

# Passed to the engine beside the EngineArgs fields (open_engine's own keywords).
ENGINE_EXTRA_KWARGS = ("runner",)

# (EngineArgs field, type, help); booleans get --flag/--no-flag.
_FLAGS: list[tuple[str, Any, str]] = [
    ("tokenizer", str, "tokenizer folder (default: the model folder)"),
    ("served_model_name", str, "model name the API reports"),
    ("revision", str, "hub revision"),
    ("dtype", str, "auto | float32 | bfloat16 | float16"),
    ("seed", int, "random seed"),
    ("max_model_len", int, "context length (default: from the model config)"),
    ("block_size", int, "KV cache block size in tokens"),
    ("max_num_seqs", int, "most sequences in one batch"),
    ("max_num_batched_tokens", int, "token budget of one step"),
    ("long_prefill_token_threshold", int, "cap on one request's prefill chunk (0 = none)"),
    ("enable_prefix_caching", bool, "reuse KV blocks of shared prefixes"),
    ("scheduling_policy", str, "fcfs | priority"),
    ("tensor_parallel_size", int, "tensor-parallel ranks"),
    ("data_parallel_size", int, "engine cores (data parallelism)"),
    ("pipeline_parallel_size", int, "pipeline stages (tensor x pipeline ranks)"),
    ("kv_cache_memory", "memory", "KV cache budget on CPU, e.g. 2GiB"),
    ("gpu_memory_utilization", float, "fraction of GPU memory for weights + KV cache"),
    ("num_gpu_blocks_override", int, "fixed number of KV blocks"),
    ("max_logprobs", int, "most logprobs a request may ask for"),
    ("stream_interval", int, "streamed outputs wake their reader every N tokens"),
    ("device", str, "auto | cpu | cuda"),
    ("attention_backend", str, "torch | triton | flashinfer | eager (default: best available)"),
    ("numerics", str, "fast | transformers (every op as transformers computes it)"),
    ("distributed_executor_backend", str, "mp | uni"),
    ("generation_config", str, "auto | vllm | a folder"),
    ("trust_remote_code", bool, "allow custom model code"),
    ("enforce_eager", bool, "no step-program replay of small CPU decode steps"),
    ("chat_template", str, "Jinja chat template file or string"),
    ("skip_tokenizer_init", bool, "token ids in and out only"),
    ("reasoning_parser", str, "deepseek_r1 | qwen3: grammars apply after the reasoning"),
    ("structured_outputs_cache_bytes", "memory", "compiled grammars kept (LRU), e.g. 512MiB"),
    ("quantization", str, "fp8: linear weights quantized to fp8 e4m3 at load (CPU)"),
    ("kv_cache_dtype", str, "auto | bfloat16 | fp8 | fp8_e4m3 (KV cache storage, CPU)"),
    ("enable_lora", bool, "LoRA adapters (requests name them)"),
    ("max_loras", int, "most LoRA adapters resident at once"),
    ("max_lora_rank", int, "largest LoRA rank accepted"),
    ("load_format", str, "auto | safetensors | gguf"),
    ("dequantize_gguf", bool, "load a GGUF's quantized tensors dequantized to the run's dtype"),
    ("speculative_config", json.loads, 'speculative decoding, JSON: {"method": "ngram", ...}'),
    ("convert", str, "auto | none | embed (embed: a pooling model, as --runner pooling)"),
    ("pooler_config", json.loads, 'pooling model: {"pooling_type": "LAST|MEAN|CLS", ...}'),
    ("nnodes", int, "machines the tensor-parallel ranks run on (others: serve --headless)"),
    ("node_rank", int, "this machine's index (the engine runs on node 0)"),
    ("master_addr", str, "node 0's address: the torch.distributed rendezvous"),
    ("master_port", int, "the rendezvous port (default: 29500 with --nnodes > 1)"),
    ("distributed_timeout_seconds", float, "a collective waiting longer stops the engine"),
]


def add_engine_args(parser: argparse.ArgumentParser, *, positional_model: bool = True) -> None:
    """Add the engine flags (and the model, positional and/or --model) to ``parser``."""
    g = parser.add_argument_group("engine")
    if positional_model:
        g.add_argument(
            "model_tag", nargs="?", default=None, metavar="MODEL", help="model folder or hub id"
        )
    g.add_argument("--model", default=None, help="model folder or hub id (same as MODEL)")
    g.add_argument(
        "--runner",
        default=None,
        help="auto | generate | pooling (vLLM's runner), or a model runner as module:Class, "
        "e.g. trillm.worker.fake_runner:FakeModelRunner (a near-zero-cost model: what remains "
        "is engine overhead)",
    )
    for name, kind, help_text in _FLAGS:
        flag = "--" + name.replace("_", "-")
        if kind == "memory":
            g.add_argument(flag, type=_memory_size, default=None, help=help_text)
        elif kind is bool:
            g.add_argument(
                flag, action=argparse.BooleanOptionalAction, default=None, help=help_text
            )
        else:
            g.add_argument(flag, type=kind, default=None, help=help_text)


def _memory_size(value: str) -> int:
    try:
        return parse_memory_size(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def engine_kwargs_from_namespace(args: argparse.Namespace) -> dict[str, Any]:
    """The engine flags the user gave, as ``LLM``/``open_engine`` keywords (model excluded)."""
    known = ({f.name for f in fields(EngineArgs)} - {"model"}) | set(ENGINE_EXTRA_KWARGS)
    return {k: v for k, v in vars(args).items() if k in known and v is not None}


def model_from_namespace(args: argparse.Namespace) -> str | None:
    tag, flag = getattr(args, "model_tag", None), getattr(args, "model", None)
    if tag is not None and flag is not None and tag != flag:
        raise ValueError(f"Two different models given: MODEL={tag!r} and --model={flag!r}.")
    return tag or flag


def engine_args_from_namespace(args: argparse.Namespace) -> EngineArgs:
    """The EngineArgs alone (``--runner`` is not one of its fields)."""
    kwargs = engine_kwargs_from_namespace(args)
    for name in ENGINE_EXTRA_KWARGS:
        kwargs.pop(name, None)
    return EngineArgs.from_kwargs(model_from_namespace(args), **kwargs)
