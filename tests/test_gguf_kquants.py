"""GGUF K-quants (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K): Q4_K and Q6_K kept quantized (issue 13), the
others dequantized at load (issue 15).

trillm's dequantizer (``gguf_kquants``) equals the gguf package's bit for bit on random blocks
(every bit pattern is a valid block); a tiny llama GGUF mixing every K-quant with Q4_0 / Q8_0
and F16 (Q4_0, Q4_K and Q6_K layers kept quantized) gives transformers' greedy output on the same
weights.
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from transformers import AutoTokenizer

from tests.hf_reference import hf_greedy
from trillm import LLM, SamplingParams
from trillm.config import EngineArgs
from trillm.model_executor import gguf_kquants, gguf_loader
from trillm.model_executor.loader import build_model, load_model_config
from trillm.testing.gguf_models import random_kquant_blocks, write_tiny_gguf
from trillm.testing.tiny_models import build_tiny_model

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.mark.parametrize("type_name", list(gguf_kquants.BLOCK_BYTES))
def test_dequantize_equals_the_gguf_package(type_name):
    raw = random_kquant_blocks(type_name, 6, 512, seed=1)  # 12 blocks
    # negative and larger super-block scales too: every sign and field combination
    size = gguf_kquants.BLOCK_BYTES[type_name]
    blocks = raw.reshape(-1, size)
    d_at = {"Q2_K": 80, "Q3_K": 108, "Q4_K": 0, "Q5_K": 0, "Q6_K": 208}[type_name]
    d = np.random.default_rng(2).uniform(-2, 2, len(blocks)).astype(np.float16)
    blocks[:, d_at : d_at + 2] = d.view(np.uint8).reshape(-1, 2)
    want = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[type_name]).reshape(-1)
    got = gguf_kquants.dequantize(torch.from_numpy(raw), type_name)
    assert got.dtype == torch.float32 and got.shape == (6 * 512,)
    np.testing.assert_array_equal(got.numpy(), want)
    assert np.count_nonzero(want) > want.size // 2  # the blocks are not trivially zero


def test_dequantize_refuses_partial_blocks_and_other_types():
    with pytest.raises(ValueError, match="whole blocks of 144 bytes"):
        gguf_kquants.dequantize(torch.zeros(143, dtype=torch.uint8), "Q4_K")
    with pytest.raises(ValueError, match="Q5_0 is not a K-quant"):
        gguf_kquants.dequantize(torch.zeros(22, dtype=torch.uint8), "Q5_0")


# q/k/v mix K-quants with Q8_0 (its Q5_K shard is not a kept type: the layer runs dequantized,
# tests/test_gguf_mixed.py keeps mixes of kept types); gate/up Q4_0, o Q4_K and down Q6_K are
# kept quantized; the rest are K-quants
TYPES = {"attn_q": "Q4_K", "attn_k": "Q5_K", "attn_v": "Q8_0", "attn_output": "Q4_K",
         "ffn_gate": "Q4_0", "ffn_up": "Q4_0", "ffn_down": "Q6_K", "output": "Q2_K",
         "token_embd": "Q3_K"}  # fmt: skip


@pytest.fixture(scope="module")
def kquant_gguf(tmp_path_factory):
    hf = build_tiny_model("llama", tmp_path_factory.mktemp("hf"), hidden_size=256,
                          intermediate_size=256, head_dim=64)  # rows of whole 256-value blocks
    return write_tiny_gguf(hf, tmp_path_factory.mktemp("gguf"), TYPES)


def test_k_quant_gguf_greedy_equals_transformers(kquant_gguf):
    """K-quant layers dequantized beside Q4_0 / Q4_K / Q6_K blocks kept quantized (the default for a
    file holding both); an all-dequantized run differs only in those layers (tests/test_gguf.py)."""
    file = gguf_loader.GGUFFile(kquant_gguf)
    assert set(file.tensor_types.values()) >= {"Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"}
    folder = kquant_gguf.parent / "dequantized"
    tok = AutoTokenizer.from_pretrained(str(folder))
    prompts = [tok(p).input_ids for p in ["In the beginning", "A"]]
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    with LLM(str(kquant_gguf), max_model_len=128, kv_cache_memory="8MiB",
             distributed_executor_backend="uni") as llm:  # fmt: skip
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    got = [o.outputs[0].token_ids for o in outs]
    assert got == [hf_greedy(str(folder), p, 10) for p in prompts]
    assert len(set(got[0])) > 1  # not a degenerate model repeating one token


def test_k_quant_layers_load_as_floats_beside_kept_blocks(kquant_gguf):
    cfg = load_model_config(EngineArgs(model=str(kquant_gguf), device="cpu"))
    assert cfg.quantization == "gguf"  # the Q4_0 / Q8_0 / Q4_K / Q6_K tensors stay quantized
    model = build_model(cfg, None, "cpu")
    layer = model.model.layers[0]
    assert layer.mlp.gate_up_proj.quantized_weight.qtype == 2  # Q4_0 blocks, kept
    o_proj = layer.self_attn.o_proj  # Q4_K, kept: 5.5 bits a value, no float weight
    assert o_proj.quantized_weight.qtype == 12 and o_proj.weight.numel() == 0
    assert o_proj.quantized_weight.nbytes == o_proj.out_features * o_proj.in_features * 11 // 16
    down = layer.mlp.down_proj  # Q6_K, kept: 9 bits a value (one byte each, scales)
    assert down.quantized_weight.qtype == 14 and down.weight.numel() == 0
    assert down.quantized_weight.nbytes == down.out_features * down.in_features * 9 // 8
    for module in (layer.self_attn.qkv_proj,):
        assert not hasattr(module, "quantized_weight")  # K-quants (and the Q8_0 v beside them)
        assert module.weight.shape == (module.out_features, module.in_features)
    folder = kquant_gguf.parent / "dequantized"
    from safetensors.torch import load_file

    want = load_file(str(folder / "model.safetensors"))["model.layers.0.self_attn.q_proj.weight"]
    got = layer.self_attn.qkv_proj.weight[: want.shape[0]]  # the Q4_K q shard, dequantized
    torch.testing.assert_close(got.float(), want, rtol=0, atol=0)
