"""GGUF K-quants (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K), all kept quantized (issues 13, 15).

trillm's dequantizer (``gguf_kquants``, ``--dequantize-gguf``'s) equals the gguf package's bit for
bit on random blocks (every bit pattern is a valid block); a tiny llama GGUF mixing every K-quant
with Q4_0 / Q8_0 (a stacked qkv of Q4_K / Q5_K / Q8_0, a tied Q3_K embedding as the head) keeps
every projection quantized at its packed size and gives transformers' greedy output on the same
weights, and the same tokens as the file loaded dequantized.
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from hf_reference import hf_greedy
from transformers import AutoTokenizer

from trillm import LLM, SamplingParams
from trillm.config import EngineArgs
from trillm.model_executor import gguf_kquants, gguf_loader
from trillm.model_executor.loader import build_model
from trillm.model_executor.model_config import load_model_config
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


# q/k/v mix K-quants with Q8_0 (three parts), gate/up Q4_0 / Q3_K, o Q2_K, down Q5_K; no output
# tensor: the head multiplies by the tied Q3_K embedding's blocks. Layer 1 puts Q6_K / Q4_K in.
TYPES = {
    "attn_q": "Q4_K",
    "attn_k": "Q5_K",
    "attn_v": "Q8_0",
    "attn_output": "Q2_K",
    "ffn_gate": "Q4_0",
    "ffn_up": "Q3_K",
    "ffn_down": "Q5_K",
    "token_embd": "Q3_K",
    "blk.1.attn_output": "Q6_K",
    "blk.1.ffn_down": "Q4_K",
}


@pytest.fixture(scope="module")
def kquant_gguf(tmp_path_factory):
    hf = build_tiny_model(
        "llama",
        tmp_path_factory.mktemp("hf"),
        hidden_size=256,
        intermediate_size=256,
        head_dim=64,
        tie_word_embeddings=True,
    )  # rows of whole 256-value blocks
    return write_tiny_gguf(hf, tmp_path_factory.mktemp("gguf"), TYPES)


def _greedy(path, prompts: list[list[int]], **kwargs) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    with LLM(
        str(path),
        max_model_len=128,
        kv_cache_memory="8MiB",
        distributed_executor_backend="uni",
        **kwargs,
    ) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def test_k_quant_gguf_greedy_equals_transformers_and_dequantized(kquant_gguf):
    """Every K-quant layer kept quantized (fp32 activations: the prompts are under
    INT8_MIN_ROWS tokens together) gives transformers' tokens on the dequantized weights and
    the tokens of the same file loaded with ``dequantize_gguf``."""
    file = gguf_loader.GGUFFile(kquant_gguf)
    assert set(file.tensor_types.values()) >= {"Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"}
    folder = kquant_gguf.parent / "dequantized"
    tok = AutoTokenizer.from_pretrained(str(folder))
    prompts = [tok(p).input_ids for p in ["In the beginning", "A"]]
    got = _greedy(kquant_gguf, prompts)
    assert got == [hf_greedy(str(folder), p, 10) for p in prompts]
    assert got == _greedy(kquant_gguf, prompts, dequantize_gguf=True)
    assert len(set(got[0])) > 1  # not a degenerate model repeating one token


def test_every_k_quant_layer_stays_quantized_at_its_packed_size(kquant_gguf):
    from trillm.kernels import linear_q_cpu as ids
    from trillm.kernels.q_panels import num_panels

    cfg = load_model_config(EngineArgs(model=str(kquant_gguf), device="cpu"))
    assert cfg.quantization == "gguf" and cfg.tie_word_embeddings
    model = build_model(cfg, None, "cpu")
    bits = {
        ids.Q4_0: 4.5,
        ids.Q8_0: 8.5,
        ids.Q2_K: 6,
        ids.Q3_K: 6,
        ids.Q4_K: 5.5,
        ids.Q5_K: 7,
        ids.Q6_K: 6.5625 if ids.kernel_type(ids.Q6_K) == ids.Q6_KP else 9,  # the file's size
    }
    want = {
        "model.layers.0.self_attn.qkv_proj": (ids.Q4_K, ids.Q5_K, ids.Q8_0),
        "model.layers.0.self_attn.o_proj": (ids.Q2_K,),
        "model.layers.0.mlp.gate_up_proj": (ids.Q4_0, ids.Q3_K),
        "model.layers.0.mlp.down_proj": (ids.Q5_K,),
        "model.layers.1.self_attn.o_proj": (ids.Q6_K,),
        "model.layers.1.mlp.down_proj": (ids.Q4_K,),
        "lm_head": (ids.Q3_K,),  # the tied embedding's blocks
    }
    for path, qtypes in want.items():
        module = model.get_submodule(path)
        weight = module.quantized_weight
        parts = weight.parts if isinstance(weight, ids.StackedQuantizedWeight) else [weight]
        assert tuple(p.qtype for p in parts) == qtypes, path
        if path != "lm_head":
            assert module.weight.numel() == 0, path  # no float copy beside the blocks
        # each part at its packed size (panels of 16 columns)
        size = sum(
            num_panels(p.out_features) * 16 * p.in_features * bits[p.qtype] / 8 for p in parts
        )
        assert weight.nbytes == size, path
    # the head shares the embedding's float weight (the lookup needs it), not a copy
    assert model.lm_head.weight is model.model.embed_tokens.weight
    from safetensors.torch import load_file

    folder = kquant_gguf.parent / "dequantized"
    want_up = load_file(str(folder / "model.safetensors"))["model.layers.0.mlp.up_proj.weight"]
    gate_up = model.model.layers[0].mlp.gate_up_proj.quantized_weight
    got = ids.dequantize(gate_up.parts[1])  # the Q3_K up shard, from its packed form
    torch.testing.assert_close(got, want_up, rtol=0, atol=0)
