"""MLA's latent cache against the same attention expanded to MHA: one decode step of one
attention layer with DeepSeek-V2-Lite's shapes (hidden 2048, 16 heads, qk_nope 128 + rope 64,
v 128, kv_lora_rank 512, no q-LoRA), every request with ``--context`` tokens cached.

- MLA: trillm's ``MLAAttention`` (the cache holds the 512 latent + 64 roped-key values a token;
  W_UK / W_UV absorbed into the query and the output).
- expanded: the same weights and projections, but each token's K = [W_UK c, k_pe] and V = W_UV c
  (padded to 192 with zeros) of all 16 heads are cached and attended by trillm's torch backend
  (its native paged kernel on CPU where built), as a model without MLA's cache would.

Both run alternately in one process, fp32; the step's thread CPU time is timed (median).

    python benchmarks/engine/mla_decode.py [--context 1024] [--batches 1 16] [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: benchmarks.*, trillm

from benchmarks import common

BLOCK = 16
LITE = dict(  # DeepSeek-V2-Lite's attention; the rest tiny (only config.json is read)
    architectures=["DeepseekV2ForCausalLM"],
    model_type="deepseek_v2",
    hidden_size=2048,
    num_attention_heads=16,
    num_key_value_heads=16,
    kv_lora_rank=512,
    q_lora_rank=None,
    qk_nope_head_dim=128,
    qk_rope_head_dim=64,
    v_head_dim=128,
    num_hidden_layers=1,
    first_k_dense_replace=1,
    intermediate_size=64,
    moe_intermediate_size=64,
    n_routed_experts=4,
    num_experts_per_tok=2,
    vocab_size=256,
    max_position_embeddings=4096,
)


def model_config(context: int):  # -> ModelConfig
    from trillm.config import EngineArgs
    from trillm.engine.config_builder import build_config

    folder = Path(tempfile.mkdtemp(prefix="mla-bench-"))
    (folder / "config.json").write_text(json.dumps(LITE))
    args = EngineArgs(model=str(folder), dtype="float32", device="cpu", max_model_len=context + 8)
    return build_config(args).model


def decode_meta(batch: int, context: int):  # -> AttentionMetadata
    import torch

    from trillm.attention.backend import AttentionMetadata

    per_req = context // BLOCK + 1
    table = torch.arange(batch * per_req, dtype=torch.int32).view(batch, per_req)
    slots = (table[:, context // BLOCK].long() * BLOCK + context % BLOCK).contiguous()
    seq = torch.full((batch,), context + 1, dtype=torch.int32)
    return AttentionMetadata(
        num_reqs=batch,
        num_tokens=batch,
        query_start_loc=torch.arange(batch + 1, dtype=torch.int32),
        seq_lens=seq,
        context_lens=seq - 1,
        block_table=table,
        slot_mapping=slots,
        max_query_len=1,
        max_seq_len=context + 1,
        query_lens_cpu=[1] * batch,
        seq_lens_cpu=[context + 1] * batch,
    )


def expanded_forward(mla, backend, positions, hidden, rotary, kv_cache, meta):  # -> [T, H]
    """The same layer with K / V of every head cached (MHA): K = [W_UK c, k_pe], V = W_UV c."""
    import torch

    heads, nope, rope, v_dim = mla.num_heads, mla.nope_dim, mla.rope_dim, mla.v_dim
    q = mla.q_proj(hidden).view(-1, heads, nope + rope)
    latent, k_pe = mla.kv_a_proj_with_mqa(hidden).split([mla.latent_dim, rope], -1)
    latent = mla.kv_a_layernorm(latent.contiguous())
    q_pe, k_pe = mla._rope(positions, q[..., nope:], k_pe[:, None], rotary)
    kv = mla.kv_b_proj(latent).view(-1, heads, nope + v_dim)
    k = torch.cat([kv[..., :nope], k_pe.expand(-1, heads, rope)], dim=-1)
    v = torch.nn.functional.pad(kv[..., nope:], (0, nope + rope - v_dim))
    q = torch.cat([q[..., :nope], q_pe], dim=-1)
    out = backend.forward(q, k, v, kv_cache, meta, mla.scale)[..., :v_dim]
    return mla.o_proj(out.reshape(-1, heads * v_dim))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    common.set_threads(args.threads)
    import torch

    from trillm.attention.torch_backend import TorchAttentionBackend
    from trillm.model_executor.layers.rotary import RotaryEmbedding
    from trillm.model_executor.models.deepseek_mla import MLAAttention, MLAPlan

    cfg = model_config(args.context)
    torch.manual_seed(0)
    with torch.inference_mode():
        mla = MLAAttention(cfg, MLAPlan(), interleaved=True).eval()
        rotary = RotaryEmbedding(64, cfg.rope_theta, None, 4096, max_positions=args.context + 8)
        backend = TorchAttentionBackend()
        heads, qk = 16, 128 + 64
        row = {"mla": 512 + 64, "expanded": 2 * heads * qk}  # values a token and layer

        def measure(batch: int) -> dict:
            blocks = batch * (args.context // BLOCK + 1)
            latent_cache = torch.randn(1, blocks, BLOCK, 1, row["mla"])
            kv_cache = torch.randn(2, blocks, BLOCK, heads, qk)
            meta = decode_meta(batch, args.context)
            hidden = torch.randn(batch, cfg.hidden_size)
            positions = torch.full((batch,), args.context, dtype=torch.int64)

            def mla_step() -> None:
                mla(positions, hidden, rotary, latent_cache, meta)

            def expanded_step() -> None:
                backend.plan(meta)
                expanded_forward(mla, backend, positions, hidden, rotary, kv_cache, meta)

            mla_ms = common.median_thread_ms(mla_step, args.repeats)
            expanded_ms = common.median_thread_ms(expanded_step, args.repeats)
            return dict(
                batch=batch,
                mla_ms=mla_ms,
                expanded_ms=expanded_ms,
                expanded_over_mla=expanded_ms / mla_ms,
                cache_mib_mla=latent_cache.numel() * 4 / 2**20,
                cache_mib_expanded=kv_cache.numel() * 4 / 2**20,
            )

        rows = common.run_rounds(args.rounds, args.batches, measure)
    print(f"cache values a token and layer: MLA {row['mla']}, expanded {row['expanded']}")
    common.print_table(
        rows,
        [
            ("round", "d"),
            ("batch", "d"),
            ("mla_ms", ".2f"),
            ("expanded_ms", ".2f"),
            ("expanded_over_mla", ".2f"),
            ("cache_mib_mla", ".1f"),
            ("cache_mib_expanded", ".1f"),
        ],
    )
    common.write_json(
        args.out, {"machine": common.machine_info(), "args": vars(args), "rows": rows}
    )


if __name__ == "__main__":
    main()
