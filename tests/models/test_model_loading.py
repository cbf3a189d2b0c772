"""Model loading: config.json parsing (transformers 4 and 5 keys), rope numerics against
transformers' ROPE_INIT_FUNCTIONS, dtype rules, sharded safetensors, and the errors."""

from __future__ import annotations

import json

import pytest
import torch

from trillm.config import EngineArgs
from trillm.model_executor import model_config
from trillm.model_executor.layers.linear import dense_weight
from trillm.model_executor.layers.rotary import compute_inv_freq
from trillm.model_executor.loader import build_model
from trillm.model_executor.model_config import (
    UnsupportedDtypeError,
    load_model_config,
    parse_rope,
    resolve_dtype,
)
from trillm.model_executor.model_files import ModelNotFoundError
from trillm.model_executor.registry import UnsupportedArchitectureError
from trillm.testing.tiny_models import build_tiny_model

YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512}
LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return build_tiny_model("llama", tmp_path_factory.mktemp("llama"))


def _rewrite_config(folder, **changes):
    path = folder / "config.json"
    cfg = json.loads(path.read_text())
    for key, value in changes.items():
        if value is None:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    path.write_text(json.dumps(cfg))


def _copy(src, dst):
    import shutil

    shutil.copytree(src, dst)
    return dst


# ---------------------------------------------------------------- config.json parsing


def test_transformers5_keys(llama_dir):
    cfg = load_model_config(EngineArgs(model=str(llama_dir), device="cpu"))
    assert cfg.architecture == "LlamaForCausalLM"
    assert (cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads) == (64, 4, 2)
    assert cfg.head_dim == 32  # != hidden / heads
    assert cfg.rope_theta == 10000.0 and cfg.rope_scaling is None
    assert cfg.dtype == "float32"
    assert cfg.max_model_len == cfg.max_position_embeddings == 2048
    assert cfg.eos_token_ids == [2, 0]  # config's 2, then generation_config's [2, 0]
    assert cfg.tokenizer == str(llama_dir) and cfg.served_model_name == str(llama_dir)


def test_transformers4_keys(llama_dir, tmp_path):
    folder = _copy(llama_dir, tmp_path / "tf4")
    _rewrite_config(
        folder,
        dtype=None,
        rope_parameters=None,
        torch_dtype="float32",
        rope_theta=500000.0,
        rope_scaling={"type": "linear", "factor": 2.0},
        eos_token_id=[7, 2],
    )
    cfg = load_model_config(EngineArgs(model=str(folder), device="cpu", generation_config="vllm"))
    assert cfg.rope_theta == 500000.0
    assert cfg.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    assert cfg.eos_token_ids == [7, 2]  # generation_config.json ignored
    assert cfg.generation_config == {}


def test_rope_parameters_fill_original_max():
    hf = {"max_position_embeddings": 4096, "rope_parameters": {"rope_theta": 1e6, **YARN}}
    del hf["rope_parameters"]["original_max_position_embeddings"]
    theta, scaling = parse_rope(hf)
    assert theta == 1e6
    assert scaling == {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096}


def test_unknown_rope_type():
    with pytest.raises(ValueError, match="Unsupported rope type 'dynamic_ntk'; supported: default"):
        parse_rope({"rope_parameters": {"rope_type": "dynamic_ntk", "rope_theta": 1.0}})
    # Phi-3's older name, its longrope only in a Phi-3 config (tests/models/test_longrope.py)
    with pytest.raises(ValueError, match="Unsupported rope type 'su'"):
        parse_rope({"rope_scaling": {"type": "su", "short_factor": [1.0]}})


def test_rope_per_layer_type_reads_the_global_layers():
    hf = {
        "rope_parameters": {
            "sliding_attention": {"rope_type": "default", "rope_theta": 10.0},
            "full_attention": {"rope_type": "linear", "rope_theta": 100.0, "factor": 2.0},
        }
    }
    assert parse_rope(hf) == (100.0, {"rope_type": "linear", "factor": 2.0})


def test_flashinfer_refuses_a_model_with_windows_or_softcap():
    from trillm.attention.backend import UnsupportedAttentionFeatureError, check_backend_supports
    from trillm.attention.flashinfer_backend import FlashInferAttentionBackend

    check_backend_supports(FlashInferAttentionBackend, None, None)  # plain layers: fine
    for window, softcap in ((8, None), (None, 50.0)):
        with pytest.raises(UnsupportedAttentionFeatureError, match="flashinfer attention backend"):
            check_backend_supports(FlashInferAttentionBackend, window, softcap)


@pytest.mark.parametrize(
    "rope",
    [
        {"rope_type": "default"},
        {"rope_type": "linear", "factor": 3.0},
        LLAMA3,
        YARN,
        {**YARN, "beta_fast": 16, "beta_slow": 2, "truncate": False},
        {**YARN, "mscale": 1.0, "mscale_all_dim": 0.5},
        {**YARN, "attention_factor": 1.5},
    ],
    ids=["default", "linear", "llama3", "yarn", "yarn-beta", "yarn-mscale", "yarn-attn"],
)
@pytest.mark.parametrize("head_dim", [32, 24])
def test_inv_freq_matches_transformers(rope, head_dim):
    import transformers
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf_cfg = transformers.LlamaConfig(
        hidden_size=64,
        num_attention_heads=4,
        head_dim=head_dim,
        max_position_embeddings=2048,
        rope_parameters={"rope_theta": 50000.0, **rope},
    )
    if rope["rope_type"] == "default":
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        ref = LlamaRotaryEmbedding.compute_default_rope_parameters(hf_cfg)
    else:
        ref = ROPE_INIT_FUNCTIONS[rope["rope_type"]](hf_cfg, "cpu")
    theta, scaling = parse_rope(hf_cfg.to_dict())
    inv_freq, attention_factor = compute_inv_freq(head_dim, theta, scaling, 2048)
    assert torch.equal(inv_freq, ref[0])
    assert attention_factor == pytest.approx(ref[1], rel=1e-12)


# ---------------------------------------------------------------- dtype


def test_explicit_float16_on_cpu_runs_in_float16():
    assert resolve_dtype("float16", "float32", "cpu") == "float16"
    assert resolve_dtype("half", "bfloat16", "cpu", "llama") == "float16"
    with pytest.raises(UnsupportedDtypeError, match="not supported for model type 'gemma3'"):
        resolve_dtype("float16", "bfloat16", "cpu", "gemma3")


def test_unknown_dtype_names_supported():
    with pytest.raises(
        UnsupportedDtypeError,
        match="Unsupported dtype 'int8'; supported: auto, float32, bfloat16, float16",
    ):
        resolve_dtype("int8", "float32", "cpu")


# --dtype auto on CPU, per CPU capability: tests/models/test_dtype_choice.py


def test_auto_dtype_on_gpu_keeps_checkpoint():
    assert resolve_dtype("auto", "bfloat16", "cuda") == "bfloat16"
    assert resolve_dtype("auto", "float16", "cuda") == "float16"
    assert resolve_dtype("bf16", "float32", "cpu") == "bfloat16"


def test_checkpoint_dtype_from_either_key():
    assert model_config.checkpoint_dtype({"torch_dtype": "bfloat16"}) == "bfloat16"
    assert model_config.checkpoint_dtype({"dtype": "float16"}) == "float16"
    assert model_config.checkpoint_dtype({}) == "float32"


# ---------------------------------------------------------------- limits and errors


def test_max_model_len(llama_dir):
    args = EngineArgs(model=str(llama_dir), device="cpu", max_model_len=100)
    assert load_model_config(args).max_model_len == 100
    args.max_model_len = 4096
    with pytest.raises(ValueError, match=r"larger than the model's max_position_embeddings \(2048"):
        load_model_config(args)


def test_sliding_window_no_longer_caps_max_model_len(tmp_path):
    # The backends honour the window (tests/models/test_model_architectures.py checks the outputs).
    folder = build_tiny_model("mistral", tmp_path / "m", sliding_window=512)
    assert load_model_config(EngineArgs(model=str(folder), device="cpu")).max_model_len == 2048


@pytest.mark.parametrize(
    "architecture,hf,expected",
    [
        ("MistralForCausalLM", {"sliding_window": 8}, [8, 8, 8, 8]),
        ("MistralForCausalLM", {"sliding_window": None}, [None] * 4),
        ("LlamaForCausalLM", {"sliding_window": 8}, [None] * 4),  # transformers ignores it
        ("Gemma2ForCausalLM", {"sliding_window": 8}, [8, None, 8, None]),
        (
            "Gemma3ForCausalLM",
            {"sliding_window": 8, "sliding_window_pattern": 2},
            [8, None, 8, None],
        ),
        (
            "Qwen2ForCausalLM",
            {"sliding_window": 8, "use_sliding_window": True, "max_window_layers": 3},
            [None, None, None, 8],
        ),
        ("Qwen2ForCausalLM", {"sliding_window": 8}, [None] * 4),
        ("MixtralForCausalLM", {"sliding_window": 8}, [8, 8, 8, 8]),
        ("Qwen3MoeForCausalLM", {"sliding_window": 8}, [None] * 4),
        ("Qwen3MoeForCausalLM", {"sliding_window": 8, "use_sliding_window": True}, [8] * 4),
        (
            "Qwen2MoeForCausalLM",
            {"sliding_window": 8, "use_sliding_window": True, "max_window_layers": 3},
            [8, None, 8, None],
        ),
        (
            "Gemma2ForCausalLM",
            {"sliding_window": 8, "layer_types": ["full_attention"] * 3 + ["sliding_attention"]},
            [None, None, None, 8],
        ),
    ],
)
def test_layer_windows(architecture, hf, expected):
    from trillm.model_executor.layer_types import layer_windows

    assert layer_windows(hf, architecture, 4) == expected


def test_unknown_layer_type_is_refused():
    from trillm.model_executor.layer_types import layer_windows

    with pytest.raises(ValueError, match="chunked_attention"):
        layer_windows({"sliding_window": 8, "layer_types": ["chunked_attention"]}, "X", 1)


def test_unsupported_architecture(llama_dir, tmp_path):
    folder = _copy(llama_dir, tmp_path / "gpt2")
    _rewrite_config(folder, architectures=["GPT2LMHeadModel"])
    prefix = "'GPT2LMHeadModel' is not supported; supported architectures: "
    with pytest.raises(UnsupportedArchitectureError, match=prefix) as raised:
        load_model_config(EngineArgs(model=str(folder), device="cpu"))
    # The message lists every registered architecture, sorted, whichever families exist.
    listed = str(raised.value).split(prefix, 1)[1].removesuffix(".").split(", ")
    assert listed == sorted(listed)
    for name in ("GPTNeoXForCausalLM", "LlamaForCausalLM", "Olmo2ForCausalLM", "Phi3ForCausalLM"):
        assert name in listed


@pytest.mark.parametrize(
    "overrides,message",
    [
        ({"hidden_act": "gelu"}, "Activation 'gelu' is not supported for LlamaForCausalLM"),
        ({"partial_rotary_factor": 0.5}, "partial_rotary_factor 0.5 is not supported for Llama"),
    ],
)
def test_what_the_model_class_does_not_compute_is_refused(llama_dir, tmp_path, overrides, message):
    folder = _copy(llama_dir, tmp_path / "odd")
    _rewrite_config(folder, **overrides)
    with pytest.raises(ValueError, match=message):
        load_model_config(EngineArgs(model=str(folder), device="cpu"))


def test_hub_id_offline_is_a_clear_error(monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(ModelNotFoundError, match="'no-such-org/no-such-model' is not a local"):
        load_model_config(EngineArgs(model="no-such-org/no-such-model", device="cpu"))


def test_missing_local_folder(tmp_path):
    with pytest.raises(ModelNotFoundError, match="does not exist"):
        load_model_config(EngineArgs(model=str(tmp_path / "nope"), device="cpu"))


def test_default_model(monkeypatch, tmp_path):
    monkeypatch.setenv("TRILLM_CACHE_DIR", str(tmp_path))
    cfg = load_model_config(EngineArgs(device="cpu"))
    assert cfg.architecture == "LlamaForCausalLM"


# ---------------------------------------------------------------- weights


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_sharded_safetensors(arch, tmp_path):
    import transformers

    from trillm.attention.torch_backend import TorchAttentionBackend

    folder = build_tiny_model(arch, tmp_path / "single")
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    sharded = tmp_path / "sharded"
    hf.save_pretrained(sharded, max_shard_size="200KB")
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        (sharded / name).write_bytes((folder / name).read_bytes())
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    cfg = load_model_config(EngineArgs(model=str(sharded), device="cpu"))
    model = build_model(cfg, TorchAttentionBackend(), "cpu")
    ref = hf.state_dict()
    for i in range(cfg.num_hidden_layers):
        attn = model.model.layers[i].self_attn
        prefix = f"model.layers.{i}.self_attn."
        qkv = torch.cat([ref[prefix + f"{p}_proj.weight"] for p in "qkv"])
        assert torch.equal(dense_weight(attn.qkv_proj), qkv)  # read back from the packed copy
        assert torch.equal(dense_weight(attn.o_proj), ref[prefix + "o_proj.weight"])
        if arch == "qwen2":
            bias = torch.cat([ref[prefix + f"{p}_proj.bias"] for p in "qkv"])
            assert torch.equal(attn.qkv_proj.bias, bias)
        else:
            assert torch.equal(attn.q_norm.weight, ref[prefix + "q_norm.weight"])
    assert torch.equal(dense_weight(model.lm_head), ref["lm_head.weight"])
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == cfg.tie_word_embeddings


def test_missing_weight_is_reported(llama_dir, tmp_path):
    from safetensors.torch import load_file, save_file

    from trillm.attention.torch_backend import TorchAttentionBackend
    from trillm.model_executor.models.stacked_weights import MissingWeightsError

    folder = _copy(llama_dir, tmp_path / "broken")
    tensors = load_file(folder / "model.safetensors")
    del tensors["model.layers.1.self_attn.k_proj.weight"]
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    cfg = load_model_config(EngineArgs(model=str(folder), device="cpu"))
    with pytest.raises(MissingWeightsError, match=r"model\.layers\.1\.self_attn\.qkv_proj\.weight"):
        build_model(cfg, TorchAttentionBackend(), "cpu")
