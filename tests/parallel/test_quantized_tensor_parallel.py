"""Tensor parallelism over quantized checkpoints (issues 13 and 14): AWQ / GPTQ packed words
and groups and GGUF block rows, each rank reading only its share and keeping it quantized.

Each rank's packed slices / blocks must be the same slice of the whole layer (and a rank's
model keep them quantized); TP=2's greedy tokens must equal the one-rank engine's (Python API,
and over HTTP) on a tiny AWQ (llama, groups of 32), GPTQ (qwen2: q/k/v biases, one group of 32
per rank on o_proj), GGUF with legacy blocks (qwen2: a tied Q8_0 embedding, its blocks split
by vocabulary rows as the head; TP=2 x PP=2) and GGUF with K-quants (o_proj's K=512, Q5_K,
splits on 256-value blocks and stays quantized; q/k/v Q4_K / Q4_K / Q3_K and gate/up Q2_K / Q6_K
split by rows, each part kept; down_proj's K=768 splits inside a block and runs dequantized; an
untied Q6_K head of 4099 rows, the last rank's padded). An AWQ / GPTQ split
off a group boundary is refused by name.
The prompts are short (a step under ``INT8_MIN_ROWS`` rows): from there the kept layers round
their activations to int8, which the dequantized down_proj does not, so there TP=2 would not be
TP=1's bit for bit (a split on whole blocks rounds the same 16-value halves as one rank does).
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from parallel_reference import http_greedy_tokens
from server_harness import ServerProcess

from trillm import LLM, SamplingParams
from trillm.config import EngineArgs
from trillm.distributed.sharding import RankShapes, TensorParallelConfigError
from trillm.model_executor import awq_gptq, gguf_loader, quant_sharding
from trillm.model_executor.model_config import load_model_config
from trillm.testing import awq_gptq_models as packer
from trillm.testing.gguf_models import write_tiny_gguf
from trillm.testing.tiny_models import build_tiny_model

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPTS = ["In the beginning", "A", "Copyright holders may"]
MAX_TOKENS = 8
# float32: the AWQ / GPTQ checkpoints are float16, which --dtype auto runs in bf16 on CPUs
# with bf16 instructions; these tests compare rank layouts, in one dtype on every host
LIMITS = {"dtype": "float32", "max_model_len": 128, "kv_cache_memory": "8MiB"}
GGUF_LEGACY = {
    "attn_q": "Q8_0",
    "attn_k": "Q8_0",
    "attn_v": "Q4_1",
    "attn_output": "Q4_1",
    "ffn_gate": "Q4_0",
    "ffn_up": "Q4_0",
    "ffn_down": "Q8_0",
    "token_embd": "Q8_0",
}
GGUF_KQUANT = {
    "attn_q": "Q4_K",
    "attn_k": "Q4_K",
    "attn_v": "Q3_K",
    "attn_output": "Q5_K",
    "ffn_gate": "Q2_K",
    "ffn_up": "Q6_K",
    "ffn_down": "Q4_K",
    "token_embd": "Q8_0",
    "output": "Q6_K",
}
KQUANT_SHAPES = {"hidden_size": 256, "head_dim": 128, "intermediate_size": 768, "vocab_size": 4099}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    def tmp(name):
        return tmp_path_factory.mktemp(name)

    out = {}
    for key, arch, method in (("awq", "llama", "awq"), ("gptq", "qwen2", "gptq")):
        quantized, _ = packer.write_tiny_group_quantized(
            build_tiny_model(arch, tmp(arch)), tmp(key), method, 32, sym=key == "gptq"
        )
        out[key] = str(quantized)
    out["gguf"] = str(
        write_tiny_gguf(build_tiny_model("qwen2", tmp("q2")), tmp("gguf"), GGUF_LEGACY)
    )
    hf = build_tiny_model("llama", tmp("kq"), **KQUANT_SHAPES)
    out["gguf-kquant"] = str(write_tiny_gguf(hf, tmp("gguf-kquant"), GGUF_KQUANT))
    return out


@pytest.fixture(scope="module")
def tp1_tokens(models):
    """The one-rank engine's greedy tokens, per model."""
    made: dict[str, list[list[int]]] = {}

    def get(key: str) -> list[list[int]]:
        if key not in made:
            with LLM(models[key], distributed_executor_backend="uni", **LIMITS) as llm:
                made[key] = _tokens(llm)
        return made[key]

    return get


def _tokens(llm: LLM) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]


@pytest.mark.parametrize("key", ["awq", "gptq"])
def test_rank_packed_slices_unpack_to_the_whole_layers_slice(models, key):
    from safetensors.torch import load_file

    cfg = load_model_config(EngineArgs(model=models[key], device="cpu", dtype="float32"))
    qcfg = awq_gptq.parse_config(cfg.hf_config)
    whole = load_file(f"{models[key]}/model.safetensors")
    for layer, dim in (("self_attn.k_proj", 0), ("self_attn.o_proj", 1), ("mlp.down_proj", 1)):
        path = f"model.layers.1.{layer}"
        tensors = {
            kind: whole[f"{path}.{kind}"] for kind in awq_gptq.PACKED if f"{path}.{kind}" in whole
        }
        q, scales, zeros = awq_gptq.unpack(qcfg, path, tensors)  # [N, K], [N, G], [N, G]
        group = q.shape[1] // scales.shape[1]
        for rank in range(2):
            shapes = RankShapes.of(cfg, rank, 2)
            part = {
                kind: quant_sharding.read_packed_shard(cfg, shapes, f"{path}.{kind}", t)
                for kind, t in tensors.items()
            }
            got = awq_gptq.unpack(qcfg, path, part)
            _, start, length = shapes.split_of(cfg, f"{path}.weight")
            if dim == 0:
                want = (
                    q[start : start + length],
                    scales[start : start + length],
                    zeros[start : start + length],
                )
            else:
                groups = slice(start // group, (start + length) // group)
                want = (q[:, start : start + length], scales[:, groups], zeros[:, groups])
            for a, b in zip(got, want, strict=True):
                assert np.array_equal(a, b), (key, layer, rank)


def test_gguf_rank_blocks_are_the_whole_tensors_slice_or_none_inside_a_block(models):
    cfg = load_model_config(EngineArgs(model=models["gguf-kquant"], device="cpu"))
    tensors = {t.name: t for t in gguf_loader.GGUFFile(cfg.model).tensors()}
    shapes = RankShapes.of(cfg, 1, 2)
    for name in (
        "model.layers.0.self_attn.o_proj.weight",
        "model.layers.0.self_attn.v_proj.weight",
        "lm_head.weight",
    ):
        t = tensors[name]
        whole = gguf_loader.dequantized_tensor(t)
        got = gguf_loader.dequantized_tensor(quant_sharding.gguf_shard(cfg, shapes, t))
        want = shapes.read_shard(cfg, name, whole)  # lm_head: 2049 rows and a zero row
        assert torch.equal(got, want), name
    # down_proj: K=768 splits at 384, inside a 256-value Q4_K block: no blocks, but the rank's
    # columns of the blocks that cover them, dequantized
    down = tensors["model.layers.0.mlp.down_proj.weight"]
    assert quant_sharding.gguf_shard(cfg, shapes, down) is None
    got = quant_sharding.gguf_dequantized_columns(cfg, shapes, down)
    assert torch.equal(got, gguf_loader.dequantized_tensor(down)[:, 384:])


def test_a_rank_keeps_its_share_quantized(models, monkeypatch):
    """Rank 1 of 2 built in this process (no collective runs while loading): its layers hold
    their halves in blocks / 4-bit groups; the GGUF down_proj split inside a block is floats."""
    from trillm.distributed import parallel_state
    from trillm.model_executor.layers import quantized_linear
    from trillm.model_executor.layers.linear import dense_weight
    from trillm.model_executor.loader import build_model

    linear_q_cpu = quantized_linear.linear_q_cpu

    monkeypatch.setattr(parallel_state, "_group", parallel_state.TensorParallelGroup(1, 2))
    cfg = load_model_config(EngineArgs(model=models["gguf-kquant"], device="cpu"))
    model = build_model(cfg, None, "cpu")
    layer = model.model.layers[0]
    o_proj, qkv = layer.self_attn.o_proj, layer.self_attn.qkv_proj
    assert (o_proj.quantized_weight.qtype, o_proj.in_features) == (linear_q_cpu.Q5_K, 256)
    assert qkv.quantized_weight.qtypes == (linear_q_cpu.Q4_K, linear_q_cpu.Q3_K)
    assert [p.out_features for p in qkv.quantized_weight.parts] == [256 + 128, 128]
    gate_up = layer.mlp.gate_up_proj.quantized_weight  # Q2_K gate, Q6_K up: rows 384 each
    assert gate_up.qtypes == (linear_q_cpu.Q2_K, linear_q_cpu.Q6_K)
    assert [p.out_features for p in gate_up.parts] == [384, 384]
    down = layer.mlp.down_proj
    assert not hasattr(down, "quantized_weight") and dense_weight(down).shape == (256, 384)
    assert model.lm_head.quantized_weight.out_features == 2050  # 2049 rows and a zero row
    awq = build_model(load_model_config(EngineArgs(model=models["awq"], device="cpu")), None, "cpu")
    down = awq.model.layers[1].mlp.down_proj
    assert (down.quantized_weight.qtype, down.in_features) == (linear_q_cpu.Q4_G, 64)


@pytest.mark.parametrize("key", ["awq", "gptq", "gguf-kquant"])  # gguf: TP=2 x PP=2 below
def test_tp2_matches_tp1_on_a_quantized_checkpoint(models, tp1_tokens, key):
    with LLM(models[key], tensor_parallel_size=2, **LIMITS) as llm:
        got = _tokens(llm)
    want = tp1_tokens(key)
    assert got == want
    assert all(len(set(t)) > 1 for t in want), want  # not one repeated token


def test_tp2_x_pp2_matches_tp1_on_a_gguf(models, tp1_tokens):
    with LLM(models["gguf"], tensor_parallel_size=2, pipeline_parallel_size=2, **LIMITS) as llm:
        assert _tokens(llm) == tp1_tokens("gguf")


def test_http_tp2_serves_an_awq_checkpoint_as_tp1(models, tp1_tokens, tmp_path):
    flags = ["--tensor-parallel-size", "2", "--dtype", "float32", "--max-model-len", "128"]
    flags += ["--kv-cache-memory", "8MiB"]
    srv = ServerProcess([models["awq"], *flags], tmp_path / "serve.log").start()
    try:
        got = http_greedy_tokens(srv.base_url, PROMPTS, MAX_TOKENS)
    finally:
        srv.stop()
    assert got == tp1_tokens("awq")


def test_a_split_off_a_group_boundary_is_refused_by_name(models, tmp_path):
    folder = tmp_path / "g64"
    shutil.copytree(models["gptq"], folder)
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"]["group_size"] = 64  # o_proj's K=64: 32 inputs per rank
    (folder / "config.json").write_text(json.dumps(config))
    assert load_model_config(EngineArgs(model=str(folder), device="cpu")).quantization == "gptq"
    message = (
        r"tensor_parallel_size=2: the GPTQ layer o_proj \(N=64 outputs, K=64 inputs; "
        r"row-parallel\) .*32 inputs per rank from input 0, not whole groups of "
        r"group_size=64"
    )
    with pytest.raises(TensorParallelConfigError, match=message):
        load_model_config(EngineArgs(model=str(folder), device="cpu", tensor_parallel_size=2))
    with pytest.raises(TensorParallelConfigError, match=message):
        LLM(str(folder), tensor_parallel_size=2, **LIMITS)
