"""GGUF layers that stack tensors of different types, as llama.cpp's mixed formats store them
(``Q4_K_M``: q/k Q4_K, v Q6_K, down Q6_K every other layer), stay quantized (issue 13).

A stacked layer (qkv, gate_up) whose shards come in different kept types is a
``StackedQuantizedWeight``: one part per run of shards of one type, one kernel call each, each
writing its columns of the output. The kernel test checks it against dequantize-then-matmul
(fp32 and int8 activations, bias, bf16 output); the model tests load a tiny GGUF mixing Q4_K /
Q6_K / Q8_0 / Q4_1 per layer, assert every projection's types, and compare greedy output with
transformers reading the same GGUF file.
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from trillm import LLM, SamplingParams
from trillm.config import EngineArgs
from trillm.kernels import linear_q_cpu
from trillm.model_executor.loader import build_model
from trillm.model_executor.model_config import load_model_config
from trillm.testing.gguf_models import random_kquant_blocks, write_tiny_gguf
from trillm.testing.tiny_models import build_tiny_model

pytestmark = pytest.mark.usefixtures("one_torch_thread")

Q = gguf.GGMLQuantizationType
# layer 0 as Q4_K_M stores it; layer 1 mixes three types in qkv and two legacy types in gate_up
TYPES = {
    "blk.0.attn_q": "Q4_K",
    "blk.0.attn_k": "Q4_K",
    "blk.0.attn_v": "Q6_K",
    "blk.0.attn_output": "Q4_K",
    "blk.0.ffn_gate": "Q4_K",
    "blk.0.ffn_up": "Q4_K",
    "blk.0.ffn_down": "Q6_K",
    "blk.1.attn_q": "Q4_1",
    "blk.1.attn_k": "Q8_0",
    "blk.1.attn_v": "Q4_K",
    "blk.1.attn_output": "Q6_K",
    "blk.1.ffn_gate": "Q8_0",
    "blk.1.ffn_up": "Q4_1",
    "blk.1.ffn_down": "Q4_K",
    "token_embd": "Q6_K",
    "output": "Q6_K",
}
PROMPTS = ["In the beginning", "A"]  # under INT8_MIN_ROWS tokens together: fp32 activations
MAX_TOKENS = 10


def _blocks(type_name: str, n: int, k: int, seed: int) -> np.ndarray:
    if type_name.endswith("_K"):
        return random_kquant_blocks(type_name, n, k, seed)
    values = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32) * 0.1
    return gguf.quants.quantize(values, Q[type_name])


@pytest.mark.skipif(not linear_q_cpu.available(), reason="native quantized GEMM not available")
@pytest.mark.parametrize("int8", [False, True], ids=["fp32-act", "int8-act"])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_stacked_parts_equal_dequantize_then_matmul(int8, out_dtype):
    if int8 and not linear_q_cpu.int8_available():
        pytest.skip("no AVX512-VNNI")
    k = 512
    # odd part sizes: a part ends inside a panel of 16 columns and the next starts mid-row;
    # Q5_K (repacked as Q5_KM), Q3_K and Q2_K (as Q4_KM) beside the types kept as they are
    sizes = [
        ("Q4_K", 40),
        ("Q6_K", 24),
        ("Q8_0", 8),
        ("Q4_1", 50),
        ("Q5_K", 17),
        ("Q3_K", 9),
        ("Q2_K", 30),
    ]
    parts = [
        linear_q_cpu.QuantizedWeight(_blocks(t, n, k, i), int(Q[t]), n, k)
        for i, (t, n) in enumerate(sizes)
    ]
    weight = linear_q_cpu.StackedQuantizedWeight(parts)
    assert weight.qtypes == tuple(int(Q[t]) for t, _ in sizes)
    assert weight.out_features == 178 and weight.offsets == [0, 40, 64, 72, 122, 139, 148, 178]
    x = torch.randn(5 if not int8 else 17, k)  # [M, K]; int8: over INT8_MIN_ROWS, as a model
    bias = torch.randn(178)
    got = linear_q_cpu.linear(x, weight, bias, out_dtype=out_dtype, int8_activations=int8)
    xr = linear_q_cpu.quantize_activations(x) if int8 else x
    want = F.linear(xr, torch.cat([linear_q_cpu.dequantize(p) for p in parts]), bias)
    assert got.dtype == out_dtype and got.shape == (x.shape[0], 178)
    tol = 1e-2 if out_dtype == torch.bfloat16 else 1e-4
    torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol)
    # each part's columns are its own GEMM's: the same as that part alone
    for i, (start, end) in ((1, (40, 64)), (4, (122, 139))):
        alone = linear_q_cpu.linear(
            x, parts[i], bias[start:end], out_dtype=out_dtype, int8_activations=int8
        )
        torch.testing.assert_close(got[:, start:end], alone, rtol=0, atol=0)


@pytest.fixture(scope="module")
def mixed_gguf(tmp_path_factory):
    hf = build_tiny_model(
        "llama", tmp_path_factory.mktemp("hf"), hidden_size=256, intermediate_size=256, head_dim=64
    )  # rows of whole 256-value blocks
    return write_tiny_gguf(hf, tmp_path_factory.mktemp("gguf"), TYPES)


def test_every_projection_of_a_mixed_gguf_stays_quantized(mixed_gguf):
    cfg = load_model_config(EngineArgs(model=str(mixed_gguf), device="cpu"))
    model = build_model(cfg, None, "cpu")
    ids = linear_q_cpu
    want = {
        "model.layers.0.self_attn.qkv_proj": (ids.Q4_K, ids.Q6_K),  # q and k in one part
        "model.layers.0.self_attn.o_proj": (ids.Q4_K,),
        "model.layers.0.mlp.gate_up_proj": (ids.Q4_K,),
        "model.layers.0.mlp.down_proj": (ids.Q6_K,),
        "model.layers.1.self_attn.qkv_proj": (ids.Q4_1, ids.Q8_0, ids.Q4_K),
        "model.layers.1.self_attn.o_proj": (ids.Q6_K,),
        "model.layers.1.mlp.gate_up_proj": (ids.Q8_0, ids.Q4_1),
        "model.layers.1.mlp.down_proj": (ids.Q4_K,),
        "lm_head": (ids.Q6_K,),
    }
    quantized_bytes = float_bytes = 0
    for path, qtypes in want.items():
        module = model.get_submodule(path)
        weight = module.quantized_weight
        got = (
            weight.qtypes
            if isinstance(weight, linear_q_cpu.StackedQuantizedWeight)
            else (weight.qtype,)
        )
        assert got == qtypes, path
        assert module.weight.numel() == 0, path  # no float copy beside the blocks
        assert weight.out_features == module.out_features, path
        quantized_bytes += weight.nbytes
        float_bytes += 4 * module.out_features * module.in_features
    qkv = model.get_submodule("model.layers.0.self_attn.qkv_proj").quantized_weight
    assert [p.out_features for p in qkv.parts] == [256 + 128, 128]
    # Q4_K 5.5 bits, Q6_K 9, Q8_0 8.5 (Q8_0 blocks: fp16 d and 32 bytes), Q4_1 6 (d, m): all
    # under a quarter of fp32's 32 bits
    assert quantized_bytes < float_bytes / 4


def _hf_greedy_from_gguf(path, prompt_ids: list[int]) -> list[int]:
    model = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    )
    config = GenerationConfig(
        do_sample=False, max_new_tokens=MAX_TOKENS, eos_token_id=None, pad_token_id=0
    )
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt_ids]),
            generation_config=config,
            attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
        )
    return out[0, len(prompt_ids) :].tolist()


def test_mixed_gguf_greedy_equals_transformers_reading_the_file(mixed_gguf):
    tok = AutoTokenizer.from_pretrained(str(mixed_gguf.parent / "dequantized"))
    prompts = [tok(p).input_ids for p in PROMPTS]
    assert sum(map(len, prompts)) < linear_q_cpu.INT8_MIN_ROWS
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    with LLM(
        str(mixed_gguf),
        max_model_len=128,
        kv_cache_memory="8MiB",
        distributed_executor_backend="uni",
    ) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    got = [o.outputs[0].token_ids for o in outs]
    assert got == [_hf_greedy_from_gguf(mixed_gguf, p) for p in prompts]
    assert len(set(got[0])) > 1  # not a degenerate model repeating one token
