"""MLA's cache win, whole model: a DeepSeek-V3-shaped random checkpoint (DeepSeek-V2-Lite's
attention widths: hidden 2048, 16 heads, qk_nope 128 + rope 64, v 128, kv_lora_rank 512, no
q-LoRA; dense MLPs so that the step is about attention) against the same model with MLA
expanded to plain multi-head attention.

- MLA: trillm's ``DeepseekV3ForCausalLM`` as served (the cache holds the 512 latent + 64 roped-key
  values a token and layer; W_UK / W_UV absorbed into the query and the output).
- expanded: the same weights, every layer's attention computing each head's K = [W_UK c, k_pe]
  and V = W_UV c from the token's latent c (after ``kv_a_layernorm``) and caching them (V padded
  to 192, as vLLM pads it without MLA) in the K/V layout the Llama-family models use, attended
  by trillm's torch backend (its native paged kernel). A Llama checkpoint cannot be this model:
  the latent's RMSNorm sits between kv_a and kv_b, and RoPE covers 64 of 192 dims with one key
  shared by the heads. Outputs are checked equal first (fp32 logprobs, prefill and decode).

KV bytes per token come from trillm's sizing (``kv_cache_sizing.block_bytes`` of each model's
``KVCacheLayout``), beside a plain Llama of the same width (16 heads of 128). Decode steps (the
model's forward and logits, eager; fp32 weights, a bf16 cache by default: trillm's fast CPU
setting, and the expanded cache of 16 x 8,192 tokens is then 3 GiB) run with every request's
context cached (random values), MLA and expanded alternating, thread CPU time, medians; the
ratio is the result.

    python benchmarks/engine/mla_cache_win.py [--layers 2] [--contexts 2048 8192] [--batches 1 16]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: benchmarks.*, trillm

from benchmarks import common

BLOCK = 16
CACHE_DIR = Path.home() / ".cache" / "trillm-bench"
V3_SHAPE = dict(  # DeepSeek-V3's model type at DeepSeek-V2-Lite's attention widths
    vocab_size=4096,
    hidden_size=2048,
    intermediate_size=2816,
    num_attention_heads=16,
    num_key_value_heads=16,
    kv_lora_rank=512,
    q_lora_rank=None,
    qk_nope_head_dim=128,
    qk_rope_head_dim=64,
    v_head_dim=128,
    n_routed_experts=4,  # unused: every layer dense (first_k_dense_replace = layers)
    num_experts_per_tok=2,
    n_group=1,
    topk_group=1,
    max_position_embeddings=16384,
)
LLAMA_SAME_WIDTH = dict(
    architectures=["LlamaForCausalLM"],
    model_type="llama",
    vocab_size=4096,
    hidden_size=2048,
    intermediate_size=2816,
    num_attention_heads=16,
    num_key_value_heads=16,
    max_position_embeddings=16384,
)


def build_checkpoint(layers: int) -> Path:
    """The random DeepSeek-V3-shaped checkpoint (transformers' init), written once."""
    folder = CACHE_DIR / f"mla-v3-lite-width-{layers}l"
    if (folder / "model.safetensors").exists():
        return folder
    import torch
    import transformers

    shape = {**V3_SHAPE, "num_hidden_layers": layers, "first_k_dense_replace": layers}
    torch.manual_seed(0)
    model = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**shape))
    model.save_pretrained(folder, safe_serialization=True)
    return folder


def trillm_config(folder: Path, dtype: str, max_len: int, kv_dtype: str = "auto"):
    from trillm.config import EngineArgs
    from trillm.engine.config_builder import build_config

    args = EngineArgs(
        model=str(folder),
        dtype=dtype,
        kv_cache_dtype=kv_dtype,
        device="cpu",
        block_size=BLOCK,
        max_model_len=max_len,
    )
    return build_config(args)  # a TrillmConfig


def bytes_per_token(config, layout) -> float:  # trillm's block sizing, per token
    from trillm.worker.kv_cache_sizing import block_bytes, kv_cache_dtype

    layers = config.model.num_hidden_layers
    return block_bytes(config, layers, layout, kv_cache_dtype(config), 0) / BLOCK


def kv_bytes(folder: Path, dtype: str, kv_dtype: str) -> dict[str, float]:
    from trillm.attention.kv_layout import KVCacheLayout
    from trillm.model_executor.registry import kv_cache_layout

    config = trillm_config(folder, dtype, 4096, kv_dtype)
    llama_folder = CACHE_DIR / "llama-lite-width"
    llama_folder.mkdir(parents=True, exist_ok=True)
    llama = {**LLAMA_SAME_WIDTH, "num_hidden_layers": config.model.num_hidden_layers}
    (llama_folder / "config.json").write_text(json.dumps(llama))
    llama_config = trillm_config(llama_folder, dtype, 4096, kv_dtype)
    heads = config.model.num_attention_heads
    return {
        "mla": bytes_per_token(config, kv_cache_layout(config.model, heads)),
        "expanded": bytes_per_token(config, KVCacheLayout.key_value(heads, 192)),
        "llama_same_width": bytes_per_token(llama_config, kv_cache_layout(llama_config.model, 16)),
    }


def load_pair(folder: Path, dtype: str, max_len: int):  # -> (mla, expanded, config)
    """The checkpoint twice: as trillm serves it, and with every layer's MLA expanded."""
    from benchmarks.engine.mla_expanded import expand_mla
    from trillm.attention.torch_backend import TorchAttentionBackend
    from trillm.model_executor.loader import build_model

    config = trillm_config(folder, dtype, max_len)
    mla = build_model(config.model, TorchAttentionBackend(), "cpu")
    expanded = build_model(config.model, TorchAttentionBackend(), "cpu")
    expand_mla(expanded, TorchAttentionBackend())
    return mla, expanded, config


def check_equal(folder: Path, steps: int = 4) -> dict[str, float]:
    """fp32: two prompts (37 and 53 tokens) prefilled together, then greedy decode steps;
    the largest |logprob| difference between the two forms, and whether the tokens agree."""
    import torch

    from benchmarks.engine.mla_expanded import LayerCaches, step_meta

    mla, expanded, _ = load_pair(folder, "float32", 256)
    caches = LayerCaches(mla, expanded, blocks=32, dtype=torch.float32, zero=True)
    prompts = [
        torch.randint(0, 4096, (n,), generator=torch.Generator().manual_seed(n)) for n in (37, 53)
    ]
    lens = [0, 0]
    ids = torch.cat(prompts)
    query = [len(p) for p in prompts]
    worst, same = 0.0, True
    with torch.inference_mode():
        for _ in range(steps + 1):
            meta = step_meta(lens, query, blocks_per_req=16)
            positions = torch.cat([torch.arange(c, c + q) for c, q in zip(lens, query)])
            last = meta.query_start_loc[1:].long() - 1
            out = []
            for model, kv in ((mla, caches.mla), (expanded, caches.expanded)):
                hidden = model(ids, positions, kv, dataclasses.replace(meta))
                out.append(torch.log_softmax(model.compute_logits(hidden[last]).float(), -1))
            worst = max(worst, (out[0] - out[1]).abs().max().item())
            same = same and bool((out[0].argmax(-1) == out[1].argmax(-1)).all())
            lens = [c + q for c, q in zip(lens, query)]
            ids, query = out[0].argmax(-1), [1, 1]
    return {"max_abs_logprob_diff": worst, "same_tokens": same}


def time_point(mla, expanded, dtype, batch: int, context: int, repeats: int) -> dict:
    """Decode steps at ``batch`` x ``context`` cached tokens, MLA and expanded alternating."""
    import torch

    from benchmarks.engine.mla_expanded import LayerCaches, step_meta

    per_req = context // BLOCK + 1
    caches = LayerCaches(mla, expanded, blocks=batch * per_req, dtype=dtype, zero=False)
    meta = step_meta([context] * batch, [1] * batch, blocks_per_req=per_req)
    ids = torch.randint(0, 4096, (batch,))
    positions = torch.full((batch,), context, dtype=torch.int64)
    times: dict[str, list[float]] = {"mla": [], "expanded": []}
    with torch.inference_mode():
        for _ in range(repeats):
            for name, model, kv in (
                ("mla", mla, caches.mla),
                ("expanded", expanded, caches.expanded),
            ):
                step = dataclasses.replace(meta)  # a new step: each form plans it again
                start = time.thread_time()
                model.compute_logits(model(ids, positions, kv, step))
                times[name].append((time.thread_time() - start) * 1e3)
    mla_ms, expanded_ms = (statistics.median(times[k]) for k in ("mla", "expanded"))
    return dict(
        batch=batch,
        context=context,
        mla_ms=mla_ms,
        expanded_ms=expanded_ms,
        expanded_over_mla=expanded_ms / mla_ms,
        cache_mib_mla=caches.mib("mla"),
        cache_mib_expanded=caches.mib("expanded"),
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--kv-cache-dtype", default="bfloat16", choices=["bfloat16", "auto"])
    p.add_argument("--contexts", type=int, nargs="+", default=[2048, 8192])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    common.set_threads(args.threads)
    import torch

    folder = build_checkpoint(args.layers)
    per_token = kv_bytes(folder, args.dtype, args.kv_cache_dtype)
    print(f"KV bytes per token ({args.kv_cache_dtype}, {args.layers} layers): {per_token}")
    check = check_equal(folder)
    print(f"MLA vs expanded, fp32: {check}", flush=True)
    mla, expanded, _ = load_pair(folder, args.dtype, max(args.contexts) + BLOCK)
    auto = args.kv_cache_dtype == "auto"
    dtype = getattr(torch, args.dtype if auto else args.kv_cache_dtype)  # the caches'
    points = [(b, c) for c in args.contexts for b in args.batches]
    rows = common.run_rounds(
        args.rounds, points, lambda bc: time_point(mla, expanded, dtype, *bc, args.repeats)
    )
    common.print_table(
        rows,
        [
            ("round", "d"),
            ("batch", "d"),
            ("context", "d"),
            ("mla_ms", ".1f"),
            ("expanded_ms", ".1f"),
            ("expanded_over_mla", ".2f"),
            ("cache_mib_mla", ".0f"),
            ("cache_mib_expanded", ".0f"),
        ],
    )
    result = {
        "command": " ".join(["python", *sys.argv]),
        "machine": common.machine_info(),
        "args": {k: str(v) for k, v in vars(args).items()},
    }
    common.write_json(
        args.out, {**result, "kv_bytes_per_token": per_token, "check": check, "rows": rows}
    )


if __name__ == "__main__":
    main()
