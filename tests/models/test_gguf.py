"""GGUF models (issue 15; Q4/Q8 kept quantized: issue 13).

Tiny random checkpoints are written as GGUF files by the test (``trillm/testing/gguf_models``,
llama.cpp's layout: q/k rows permuted, tokenizer and chat template in the metadata), with F32,
F16, BF16, Q4_0, Q4_1 and Q8_0 tensors. trillm's greedy output from the GGUF (kept quantized,
and dequantized) must equal transformers on the same weights dequantized, and transformers
reading the GGUF itself agrees with that folder (so the layout is llama.cpp's, not ours).
"""

from __future__ import annotations

import httpx
import pytest
import torch
from hf_reference import hf_greedy
from server_harness import ServerProcess
from transformers import AutoModelForCausalLM, AutoTokenizer

from trillm import LLM, SamplingParams
from trillm.config import EngineArgs
from trillm.entrypoints.cli.main import build_parser
from trillm.entrypoints.cli.serve_args import engine_kwargs
from trillm.model_executor import gguf_loader
from trillm.model_executor.loader import build_model
from trillm.model_executor.model_config import load_model_config
from trillm.model_executor.registry import UnsupportedArchitectureError
from trillm.testing.gguf_models import write_tiny_gguf
from trillm.testing.tiny_models import build_tiny_model

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TYPES = {
    # llama: q/k/v in one type (one quantized qkv matmul), BF16 and F16 float tensors
    "llama": {
        "attn_q": "Q4_0",
        "attn_k": "Q4_0",
        "attn_v": "Q4_0",
        "attn_output": "BF16",
        "ffn_gate": "Q4_1",
        "ffn_up": "Q4_1",
        "ffn_down": "Q8_0",
        "output": "F16",
        "token_embd": "Q8_0",
    },
    # qwen2: tied Q8_0 embedding (the head multiplies by its blocks), q/k/v biases, and q/k/v
    # in two types (kept quantized, a part per type)
    "qwen2": {
        "attn_q": "Q8_0",
        "attn_k": "Q8_0",
        "attn_v": "Q4_1",
        "attn_output": "Q4_1",
        "ffn_gate": "Q4_0",
        "ffn_up": "Q4_0",
        "ffn_down": "Q4_0",
        "token_embd": "Q8_0",
    },
}
PROMPTS = ["In the beginning", "Copyright holders may", "A"]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def ggufs(tmp_path_factory):
    out = {}
    for arch, types in TYPES.items():
        hf = build_tiny_model(arch, tmp_path_factory.mktemp(f"hf-{arch}"))
        out[arch] = write_tiny_gguf(hf, tmp_path_factory.mktemp(f"gguf-{arch}"), types)
    return out


@pytest.fixture(scope="module")
def engine():
    """``engine(path, dequantize) -> LLM``, one per pair for the module."""
    made: dict[tuple[str, bool], LLM] = {}

    def get(path, dequantize: bool = False) -> LLM:
        key = (str(path), dequantize)
        if key not in made:
            made[key] = LLM(
                str(path),
                max_model_len=256,
                kv_cache_memory="8MiB",
                distributed_executor_backend="uni",
                dequantize_gguf=dequantize,
            )
        return made[key]

    yield get
    for llm in made.values():
        llm.shutdown()


def _prompt_ids(folder) -> list[list[int]]:
    tok = AutoTokenizer.from_pretrained(str(folder))
    return [tok(p).input_ids for p in PROMPTS]


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("dequantize", [False, True], ids=["quantized", "dequantized"])
def test_greedy_output_equals_transformers_on_the_dequantized_weights(
    ggufs, engine, arch, dequantize
):
    path = ggufs[arch]
    folder = path.parent / "dequantized"
    llm = engine(path, dequantize)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    ids = _prompt_ids(folder)
    outs = llm.generate([{"prompt_token_ids": p} for p in ids], params, use_tqdm=False)
    for prompt, out in zip(ids, outs, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(str(folder), prompt, MAX_TOKENS)


def test_pp2_on_a_gguf_equals_one_rank(ggufs, engine):
    """Pipeline parallelism (issue 14): each stage reads (and dequantizes) only its tensors
    of the file; the tied Q8_0 embedding is stage 0's embedding and the last stage's head
    (its blocks), never a head on stage 0. Greedy tokens equal the one-rank engine's."""
    path = ggufs["qwen2"]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in engine(path).generate(PROMPTS, params, use_tqdm=False)]
    with LLM(str(path), max_model_len=256, kv_cache_memory="8MiB", pipeline_parallel_size=2) as llm:
        got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    assert got == want


def test_transformers_reads_the_gguf_as_the_dequantized_folder(ggufs):
    # transformers' own GGUF reader (it undoes llama.cpp's q/k permutation too) gives the same
    # logits as the folder: the file is laid out as llama.cpp lays it out.
    path = ggufs["llama"]
    folder = path.parent / "dequantized"
    ids = torch.tensor(_prompt_ids(folder)[:1])
    from_gguf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name)
    from_folder = AutoModelForCausalLM.from_pretrained(str(folder))
    with torch.no_grad():
        a, b = from_gguf(ids).logits.float(), from_folder(ids).logits
    torch.testing.assert_close(a, b, atol=1e-3, rtol=1e-3)


def test_tokenizer_and_chat_template_come_from_the_file(ggufs, engine):
    path = ggufs["llama"]
    folder = path.parent / "dequantized"
    tok = engine(path).get_tokenizer()
    ref = AutoTokenizer.from_pretrained(str(folder))
    for text in [*PROMPTS, "Hello, world! 123 it's"]:
        assert tok(text).input_ids == ref(text).input_ids
    assert tok.chat_template == ref.chat_template and tok.chat_template
    assert tok.eos_token == ref.eos_token == "<|im_end|>"
    cfg = load_model_config(EngineArgs(model=str(path), device="cpu"))
    assert cfg.tokenizer == str(path) and cfg.eos_token_ids == [ref.eos_token_id]


def test_quantized_layers_hold_only_their_blocks(ggufs):
    cfg = load_model_config(EngineArgs(model=str(ggufs["qwen2"]), device="cpu"))
    assert cfg.quantization == "gguf" and cfg.dtype == "float32" and cfg.tie_word_embeddings
    model = build_model(cfg, None, "cpu")
    layer = model.model.layers[0]
    quantized = {
        "o_proj": layer.self_attn.o_proj,
        "gate_up": layer.mlp.gate_up_proj,
        "down": layer.mlp.down_proj,
    }
    for name, module in quantized.items():
        assert module.weight.numel() == 0, name
        assert module.quantized_weight.nbytes < module.out_features * module.in_features, name
    assert layer.mlp.gate_up_proj.quantized_weight.qtype == 2  # Q4_0, gate and up together
    qkv = layer.self_attn.qkv_proj.quantized_weight  # q/k Q8_0 and v Q4_1: a part each
    assert qkv.qtypes == (8, 3) and layer.self_attn.qkv_proj.weight.numel() == 0
    assert model.lm_head.quantized_weight.qtype == 8  # the tied Q8_0 embedding's blocks
    assert model.model.embed_tokens.weight.shape == (cfg.vocab_size, cfg.hidden_size)
    deq = load_model_config(
        EngineArgs(model=str(ggufs["qwen2"]), device="cpu", dequantize_gguf=True)
    )
    assert deq.quantization is None


def test_a_folder_holding_one_gguf_is_the_model(ggufs, tmp_path):
    path = ggufs["llama"]
    assert gguf_loader.find_gguf(str(path.parent)) == path  # no config.json beside it
    assert gguf_loader.find_gguf(str(path.parent / "dequantized")) is None  # an HF folder
    (tmp_path / "a.gguf").write_bytes(path.read_bytes())
    (tmp_path / "b.gguf").write_bytes(b"")
    with pytest.raises(gguf_loader.GGUFError, match=r"several GGUF files \(a.gguf, b.gguf\)"):
        load_model_config(EngineArgs(model=str(tmp_path), device="cpu"))
    with pytest.raises(gguf_loader.GGUFError, match="does not exist"):
        load_model_config(EngineArgs(model=str(tmp_path / "c.gguf"), device="cpu"))


def test_load_format_and_quantization_are_honoured_or_refused(ggufs):
    gguf_path = str(ggufs["llama"])
    folder = str(ggufs["llama"].parent / "dequantized")
    ok = load_model_config(
        EngineArgs(model=gguf_path, device="cpu", load_format="gguf", quantization="gguf")
    )
    assert ok.quantization == "gguf"
    refused = [
        (dict(model=folder, load_format="gguf"), "load_format='gguf' needs a .gguf"),
        (dict(model=folder, quantization="gguf"), "quantization='gguf' needs a .gguf"),
        (dict(model=folder, dequantize_gguf=True), "dequantize_gguf needs a .gguf"),
        (dict(model=gguf_path, load_format="safetensors"), "is a GGUF file"),
        (dict(model=gguf_path, load_format="pt"), "load_format 'pt' is not supported"),
        (dict(model=gguf_path, quantization="fp8"), "'fp8' does not apply to a GGUF model"),
        (dict(model=gguf_path, quantization="gguf", dequantize_gguf=True), "choose one"),
    ]
    for kwargs, message in refused:
        with pytest.raises(ValueError, match=message):
            load_model_config(EngineArgs(device="cpu", **kwargs))


def _gguf_with(tmp_path, arch: str, tensor_type: str):
    import gguf
    import numpy as np

    writer = gguf.GGUFWriter(str(tmp_path / "m.gguf"), arch)
    values = np.random.default_rng(0).standard_normal((4, 64)).astype(np.float32)
    kind = gguf.GGMLQuantizationType[tensor_type]
    writer.add_tensor("token_embd.weight", gguf.quants.quantize(values, kind), raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(tmp_path / "m.gguf")


@pytest.mark.parametrize("bf16_instructions", [True, False])
def test_dtype_auto_runs_a_quantized_gguf_in_float32(ggufs, monkeypatch, bf16_instructions):
    """A GGUF counts as its embedding's type: a quantized embedding is float32 (activations and,
    with kv_cache_dtype auto, the KV cache), even with bf16 instructions, as a float32 checkpoint
    (docs/models.md, Dtypes); --dtype bfloat16 still overrides it."""
    from trillm.model_executor import dtype_choice

    monkeypatch.setattr(dtype_choice, "cpu_supports_bf16", lambda: bf16_instructions)
    model = str(ggufs["qwen2"])  # token_embd Q8_0
    assert gguf_loader.GGUFFile(model).checkpoint_dtype() == "float32"
    assert load_model_config(EngineArgs(model=model, device="cpu")).dtype == "float32"
    config = load_model_config(EngineArgs(model=model, device="cpu", dtype="bfloat16"))
    assert config.dtype == "bfloat16"


def test_unsupported_architectures_and_tensor_types_are_refused_by_name(tmp_path):
    with pytest.raises(UnsupportedArchitectureError, match="GGUF architecture 'gemma2'"):
        load_model_config(EngineArgs(model=_gguf_with(tmp_path, "gemma2", "F32"), device="cpu"))
    with pytest.raises(gguf_loader.GGUFError, match="tensor type.* Q5_0 are not supported"):
        load_model_config(EngineArgs(model=_gguf_with(tmp_path, "llama", "Q5_0"), device="cpu"))


def test_serve_flags_reach_the_engine_args():
    argv = [
        "serve",
        "m.gguf",
        "--quantization",
        "gguf",
        "--load-format",
        "gguf",
        "--dequantize-gguf",
    ]
    kwargs = engine_kwargs(build_parser().parse_args(argv))
    assert (kwargs["quantization"], kwargs["load_format"], kwargs["dequantize_gguf"]) == (
        "gguf",
        "gguf",
        True,
    )
    assert "dequantize_gguf" not in engine_kwargs(build_parser().parse_args(["serve", "m.gguf"]))


def test_trillm_serve_a_gguf_file_chats_with_its_template(ggufs, tmp_path):
    path = ggufs["qwen2"]
    folder = path.parent / "dequantized"
    srv = ServerProcess(
        [
            str(path),
            "--quantization",
            "gguf",
            "--load-format",
            "gguf",
            "--max-model-len",
            "256",
            "--kv-cache-memory",
            "8MiB",
            "--distributed-executor-backend",
            "uni",
        ],
        tmp_path / "serve.log",
    ).start()
    try:
        assert [m["id"] for m in httpx.get(srv.base_url + "/models").json()["data"]] == [str(path)]
        messages = [{"role": "user", "content": "In the beginning"}]
        body = {
            "model": str(path),
            "messages": messages,
            "max_tokens": 8,
            "temperature": 0,
            "ignore_eos": True,
        }
        reply = httpx.post(srv.base_url + "/chat/completions", json=body, timeout=60).json()
    finally:
        assert srv.stop() == 0
    tok = AutoTokenizer.from_pretrained(str(folder))
    prompt = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    expected = hf_greedy(str(folder), tok(prompt).input_ids, 8)
    assert reply["usage"]["prompt_tokens"] == len(tok(prompt).input_ids)  # the same template
    assert reply["choices"][0]["message"]["content"] == tok.decode(
        expected, skip_special_tokens=True
    )


def test_lora_on_a_quantized_gguf_equals_peft_on_the_dequantized_weights(ggufs, tmp_path):
    # LoRA wraps the layer's forward: here the quantized kernel's, plus the adapter's delta.
    from trillm import LoRARequest
    from trillm.testing.lora_adapters import build_peft_adapter, peft_greedy

    path = ggufs["qwen2"]
    folder = path.parent / "dequantized"
    adapter = str(build_peft_adapter(str(folder), tmp_path / "adapter", seed=1))
    ids = _prompt_ids(folder)
    expected = peft_greedy(str(folder), adapter, ids, MAX_TOKENS)
    assert expected != [hf_greedy(str(folder), p, MAX_TOKENS) for p in ids]  # it changes them
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    with LLM(
        str(path),
        enable_lora=True,
        max_model_len=256,
        kv_cache_memory="8MiB",
        distributed_executor_backend="uni",
    ) as llm:
        outs = llm.generate(
            [{"prompt_token_ids": p} for p in ids],
            params,
            use_tqdm=False,
            lora_request=LoRARequest("a", 1, adapter),
        )
    assert [o.outputs[0].token_ids for o in outs] == expected
