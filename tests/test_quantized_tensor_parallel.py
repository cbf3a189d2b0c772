"""Tensor parallelism over quantized checkpoints (issues 13 and 14): AWQ / GPTQ packed words
and groups, each rank reading only its share and keeping it quantized.

Each rank's packed slices must unpack to the same slice of the whole layer; TP=2's greedy
tokens must equal the one-rank engine's (Python API, and over HTTP) on a tiny AWQ (llama,
groups of 32) and GPTQ (qwen2: q/k/v biases, one group of 32 per rank on o_proj) checkpoint.
An AWQ / GPTQ split off a group boundary is refused by name.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from parallel_reference import http_greedy_tokens
from server_harness import ServerProcess

from trillm import LLM, SamplingParams
from trillm.config import EngineArgs
from trillm.distributed.sharding import RankShapes, TensorParallelConfigError
from trillm.model_executor import awq_gptq, quant_sharding
from trillm.model_executor.loader import load_model_config
from trillm.testing import awq_gptq_models as packer
from trillm.testing.tiny_models import build_tiny_model

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPTS = ["In the beginning", "A", "Copyright holders may"]
MAX_TOKENS = 8
LIMITS = {"max_model_len": 128, "kv_cache_memory": "8MiB"}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    def tmp(name):
        return tmp_path_factory.mktemp(name)

    out = {}
    for key, arch, method in (("awq", "llama", "awq"), ("gptq", "qwen2", "gptq")):
        quantized, _ = packer.write_tiny_group_quantized(build_tiny_model(arch, tmp(arch)),
                                                         tmp(key), method, 32, sym=key == "gptq")  # fmt: skip
        out[key] = str(quantized)
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
        tensors = {kind: whole[f"{path}.{kind}"] for kind in awq_gptq.PACKED
                   if f"{path}.{kind}" in whole}  # fmt: skip
        q, scales, zeros = awq_gptq.unpack(qcfg, path, tensors)  # [N, K], [N, G], [N, G]
        group = q.shape[1] // scales.shape[1]
        for rank in range(2):
            shapes = RankShapes.of(cfg, rank, 2)
            part = {kind: quant_sharding.read_packed_shard(cfg, shapes, f"{path}.{kind}", t)
                    for kind, t in tensors.items()}  # fmt: skip
            got = awq_gptq.unpack(qcfg, path, part)
            _, start, length = shapes.split_of(cfg, f"{path}.weight")
            if dim == 0:
                want = (q[start : start + length], scales[start : start + length],
                        zeros[start : start + length])  # fmt: skip
            else:
                groups = slice(start // group, (start + length) // group)
                want = (q[:, start : start + length], scales[:, groups], zeros[:, groups])
            for a, b in zip(got, want, strict=True):
                assert np.array_equal(a, b), (key, layer, rank)


@pytest.mark.parametrize("key", ["awq", "gptq"])
def test_tp2_matches_tp1_on_a_quantized_checkpoint(models, tp1_tokens, key):
    with LLM(models[key], tensor_parallel_size=2, **LIMITS) as llm:
        got = _tokens(llm)
    want = tp1_tokens(key)
    assert got == want
    assert all(len(set(t)) > 1 for t in want), want  # not one repeated token


def test_http_tp2_serves_an_awq_checkpoint_as_tp1(models, tp1_tokens, tmp_path):
    flags = ["--tensor-parallel-size", "2", "--max-model-len", "128", "--kv-cache-memory", "8MiB"]
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
    message = (r"tensor_parallel_size=2: the GPTQ layer o_proj \(N=64 outputs, K=64 inputs; "
               r"row-parallel\) .*32 inputs per rank from input 0, not whole groups of "
               r"group_size=64")  # fmt: skip
    with pytest.raises(TensorParallelConfigError, match=message):
        load_model_config(EngineArgs(model=str(folder), device="cpu", tensor_parallel_size=2))
    with pytest.raises(TensorParallelConfigError, match=message):
        LLM(str(folder), tensor_parallel_size=2, **LIMITS)
