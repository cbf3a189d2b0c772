"""MLA's attention over the paged latent cache (``deepseek_mla.MLAAttention._attend``) against
a per-request, per-position reference: decode rows read their context by whole blocks through
shuffled block tables (lengths that end inside a block, a padded table row), a few requests at
a time on CPU (the chunk forced down to one request) or all at once, beside a prefill chunk
with context; fp32, bf16 and fp8 caches. The numerics of whole models against transformers are
tests/models/test_deepseek.py's."""

from __future__ import annotations

import json

import pytest
import torch
from paged_batches import BS, attention_metadata

from trillm.config import EngineArgs
from trillm.engine.config_builder import build_config
from trillm.model_executor.models import deepseek_mla
from trillm.model_executor.models.deepseek_mla import MLAAttention, MLAPlan
from trillm.testing.tiny_deepseek import BASE

CONTEXT_LENS = [5, 40, 17, 0, 10]  # the last request is a prefill chunk after 10 tokens
QUERY_LENS = [1, 1, 1, 1, 6]
WIDTH = BASE["kv_lora_rank"] + BASE["qk_rope_head_dim"]


@pytest.fixture(scope="module")
def mla(tmp_path_factory):
    folder = tmp_path_factory.mktemp("mla")
    hf = {**BASE, "architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2"}
    (folder / "config.json").write_text(json.dumps({**hf, "q_lora_rank": None}))
    cfg = build_config(EngineArgs(model=str(folder), dtype="float32", device="cpu")).model
    return MLAAttention(cfg, MLAPlan(), interleaved=True)


def _batch(cache_dtype: torch.dtype):
    """(metadata, cache [1, blocks, BS, 1, L + R], queries [T, Hq, L + R], per request its
    context slots), the block tables shuffled, request 1's table row the longest."""
    g = torch.Generator().manual_seed(0)
    blocks = [-(-(c + q) // BS) for c, q in zip(CONTEXT_LENS, QUERY_LENS)]
    perm = torch.randperm(sum(blocks) + 3, generator=g).tolist()
    tables = [perm[sum(blocks[:i]) : sum(blocks[: i + 1])] for i in range(len(blocks))]
    meta = attention_metadata(CONTEXT_LENS, QUERY_LENS, tables)
    cache = torch.randn(1, sum(blocks) + 3, BS, 1, WIDTH, generator=g).to(cache_dtype)
    queries = torch.randn(meta.num_tokens, BASE["num_attention_heads"], WIDTH, generator=g)
    slots = [
        torch.tensor([t[p // BS] * BS + p % BS for p in range(c + q)])
        for t, c, q in zip(tables, CONTEXT_LENS, QUERY_LENS)
    ]
    return meta, cache, queries, slots


def _reference(mla, cache, queries, slots) -> torch.Tensor:  # [T, Hq, L]
    rows = cache.view(-1, WIDTH)
    if rows.dtype == torch.float8_e4m3fn:
        rows = rows.float()
    out, t = [], 0
    for context, query_len, slot in zip(CONTEXT_LENS, QUERY_LENS, slots):
        keys = rows[slot].float()  # [S, L + R]
        for j in range(query_len):
            seen = keys[: context + j + 1]
            probs = torch.softmax(queries[t] @ seen.T * mla.scale, dim=-1)  # [Hq, S']
            out.append(probs @ seen[:, : mla.latent_dim])
            t += 1
    return torch.stack(out)


@pytest.mark.parametrize("chunk_bytes", [8 << 20, 1], ids=["group", "per_request"])
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
def test_attend_equals_the_per_position_reference(mla, monkeypatch, chunk_bytes, cache_dtype):
    monkeypatch.setattr(deepseek_mla, "_CPU_CHUNK_BYTES", chunk_bytes)
    meta, cache, queries, slots = _batch(cache_dtype)
    groups = MLAPlan().groups(meta, BS)
    assert [g.decode for g in groups] == [True, False]
    out = mla._attend(queries, cache, groups)
    torch.testing.assert_close(out, _reference(mla, cache, queries, slots), atol=1e-5, rtol=1e-5)
