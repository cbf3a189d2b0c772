"""``numerics="transformers"``: a request's output equals transformers' own, bit for bit.

Tiny random Llama-family checkpoints in bf16 (where one rounding the other way moves later
values): transformers' eager model generates each prompt alone (greedy, its raw logits per
step); trillm generates all of them in one engine (batched decode, a shared prefix that hits
the prefix cache, a prompt split into prefill chunks) and must give the same tokens and, for
each, the same log-probability to the last bit. Where torch's GEMM on the CPU running the test
gives a row other bits at another row count (``gemm_batch_variance``, what the engine logs),
the engine runs one request at a time (the row counts transformers uses) and the same equality
holds; where it depends on the weights' memory alignment (MKL's fp32 GEMM; not seen in bf16),
only to rounding.
"""

from __future__ import annotations

import pytest
import torch

from trillm.config import EngineArgs
from trillm.model_executor import transformers_numerics
from trillm.testing.tiny_models import build_tiny_model

MAX_NEW = 8
CASES = {
    "llama": ("llama", {}),
    "qwen2": ("qwen2", {}),  # q/k/v biases, tied embedding
    "qwen3": ("qwen3", {}),  # per-head q/k norms
    "mistral-window": ("mistral", {"sliding_window": 8}),
}

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    shared = torch.randint(3, 4096, (20,), generator=g).tolist()  # a prefix-cache hit
    lens = [5, 23, 41, 12]
    prompts = [torch.randint(3, 4096, (n,), generator=g).tolist() for n in lens]
    return [*prompts, shared + [7, 8, 9], shared + [10, 11]]


def _hf_reference(path, prompts):
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.bfloat16, attn_implementation="eager"
    ).eval()
    gen = transformers.GenerationConfig(
        do_sample=False, max_new_tokens=MAX_NEW, eos_token_id=None, pad_token_id=0
    )
    refs = []
    with torch.no_grad():
        for prompt in prompts:
            out = hf.generate(
                torch.tensor([prompt]),
                generation_config=gen,
                output_logits=True,
                return_dict_in_generate=True,
            )
            tokens = out.sequences[0, len(prompt) :].tolist()
            logprobs = [
                float(torch.log_softmax(step[0].float(), dim=-1)[tok])
                for step, tok in zip(out.logits, tokens, strict=True)
            ]
            refs.append((tokens, logprobs))
    return hf, refs


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tmp_path_factory):
    arch, overrides = CASES[request.param]
    path = build_tiny_model(arch, tmp_path_factory.mktemp(request.param), **overrides)
    prompts = _prompts()
    _, refs = _hf_reference(path, prompts)
    return path, prompts, refs, _gemm_variance(path)


def _gemm_variance(path) -> list[str]:
    """What ``numerics="transformers"`` logs at load: where torch's GEMM on this CPU gives a
    row other bits (another row count, another weight alignment) for this model's shapes."""
    from trillm.attention.eager_backend import EagerAttentionBackend
    from trillm.engine.config_builder import build_config
    from trillm.model_executor.loader import build_model

    config = build_config(EngineArgs(model=str(path), numerics="transformers", dtype="bfloat16"))
    model = build_model(config.model, EagerAttentionBackend(), "cpu")
    return transformers_numerics.gemm_batch_variance(model)


def _generate(path, prompts, numerics: str, variance: list[str]):
    from trillm import LLM, SamplingParams

    # Batched, a shared prefix from the prefix cache, prompts in 32-token prefill chunks; where
    # a row's GEMM bits depend on the row count, one request at a time in transformers' shapes.
    shapes = dict(max_num_seqs=8, max_num_batched_tokens=32)
    if variance:
        shapes = dict(max_num_seqs=1, max_num_batched_tokens=256, enable_prefix_caching=False)
    llm = LLM(
        str(path),
        dtype="bfloat16",
        numerics=numerics,
        distributed_executor_backend="uni",
        **shapes,
    )
    try:
        params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=0)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    finally:
        llm.shutdown()
    results = []
    for out in outs:
        completion = out.outputs[0]
        tokens = list(completion.token_ids)
        logprobs = [
            step[tok].logprob for step, tok in zip(completion.logprobs, tokens, strict=True)
        ]
        results.append((tokens, logprobs))
    return results


def test_output_equals_transformers_bit_for_bit(case):
    path, prompts, refs, variance = case
    got = _generate(path, prompts, "transformers", variance)
    exact = not any(transformers_numerics.ALIGNMENT in v for v in variance)
    for i, ((tokens, logprobs), (ref_tokens, ref_logprobs)) in enumerate(
        zip(got, refs, strict=True)
    ):
        assert tokens == ref_tokens, f"prompt {i}: {tokens} != {ref_tokens}"
        if exact:
            assert logprobs == ref_logprobs, f"prompt {i}: {logprobs} != {ref_logprobs}"
        else:  # torch's GEMM bits follow the weights' addresses here: to rounding only
            assert logprobs == pytest.approx(ref_logprobs, abs=0.02), f"prompt {i}"


@pytest.mark.parametrize(
    ("context_lens", "query_lens"),
    [
        ([20, 70, 5], [1, 1, 1]),
        ([0, 0], [37, 9]),
        ([0, 30, 12], [20, 1, 7]),
        ([300, 1000, 0], [1, 1, 160]),
    ],
    ids=["decode", "fresh-prompts", "mixed", "long"],
)
def test_eager_backend_equals_transformers_eager_attention(context_lens, query_lens):
    """The backend against transformers' own ``eager_attention_forward``, request by request:
    equal to the bit on decode rows, fresh prompts, chunks after a context and long rows (a
    1000-key decode row, a 160-row prompt), where the native kernel's fp32 sums, in another
    order, leave a few outputs in ten thousand rounded the other way."""
    from paged_batches import HKV, SCALE, hf_eager_attention, paged_bf16_batch

    from trillm.attention.eager_backend import EagerAttentionBackend
    from trillm.attention.torch_backend import TorchAttentionBackend

    meta, cache, q, k, v, per_request = paged_bf16_batch(context_lens, query_lens, seed=2)
    outs = {}
    for name, backend in (("eager", EagerAttentionBackend()), ("native", TorchAttentionBackend())):
        step_cache = cache.clone()
        backend.plan(meta)
        outs[name] = backend.forward(q, k, v, step_cache, meta, SCALE)
    starts = meta.query_start_loc.tolist()
    native_equal = True
    for i, (ctx, slots) in enumerate(per_request):
        keys = step_cache[0].view(-1, HKV, q.shape[-1])[slots]
        values = step_cache[1].view(-1, HKV, q.shape[-1])[slots]
        rows = slice(starts[i], starts[i + 1])
        hf = hf_eager_attention(q[rows], keys, values, ctx)
        assert torch.equal(outs["eager"][rows], hf), f"request {i}"
        native_equal &= torch.equal(outs["native"][rows], hf)
    if context_lens[1] == 1000:  # the control: the native kernel's long rows are not exact
        assert not native_equal


def test_the_model_runs_transformers_ops(tmp_path):
    from trillm.attention.eager_backend import EagerAttentionBackend
    from trillm.engine.config_builder import build_config
    from trillm.model_executor.layers.norm import RMSNorm
    from trillm.model_executor.layers.rotary import RotaryEmbedding
    from trillm.model_executor.loader import build_model
    from trillm.model_executor.models.llama import LlamaMLP

    path = build_tiny_model("llama", tmp_path / "m")
    config = build_config(EngineArgs(model=str(path), numerics="transformers", dtype="bfloat16"))
    assert config.attention_backend == "eager" and config.model.numerics == "transformers"
    model = build_model(config.model, EagerAttentionBackend(), "cpu")
    switched = [m for m in model.modules() if isinstance(m, (RMSNorm, RotaryEmbedding, LlamaMLP))]
    assert switched and all(m.reference for m in switched)
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert linears and not any(hasattr(m, "packed_weight") for m in linears)
    fast = build_config(EngineArgs(model=str(path), dtype="bfloat16"))
    assert fast.attention_backend == "torch" and fast.model.numerics == "fast"


def test_the_gemm_probe_finds_what_moves_a_rows_bits(monkeypatch):
    model = torch.nn.Sequential(torch.nn.Linear(64, 32)).to(torch.bfloat16)
    bump = {"rows": 10**9, "misaligned": False}

    def gemm(x, w, b=None):  # exact (bf16 products summed in fp64), then what bump asks
        y = (x.double() @ w.double().T + (0 if b is None else b.double())).to(x.dtype)
        moved = x.shape[0] > bump["rows"] or (bump["misaligned"] and w.data_ptr() % 64 != 0)
        return y + moved * torch.finfo(y.dtype).eps * y

    monkeypatch.setattr(torch.nn.functional, "linear", gemm)
    assert transformers_numerics.gemm_batch_variance(model) == []
    bump["rows"] = 16  # rows of a call of 17 or more change
    assert transformers_numerics.gemm_batch_variance(model) == ["64 x 32 bfloat16 at 17 rows"]
    bump.update(rows=10**9, misaligned=True)
    assert transformers_numerics.gemm_batch_variance(model) == [
        f"64 x 32 bfloat16 at another {transformers_numerics.ALIGNMENT}"
    ]


@pytest.mark.parametrize(
    ("arch", "kwargs", "named"),
    [
        ("gemma", {}, "architecture"),
        ("llama", {"quantization": "fp8"}, "quantization"),
        ("llama", {"kv_cache_dtype": "bfloat16", "dtype": "float32"}, "kv_cache_dtype"),
        ("llama", {"enable_lora": True}, "enable_lora"),
        ("llama", {"tensor_parallel_size": 2}, "tensor_parallel_size"),
        ("llama", {"attention_backend": "torch"}, "attention_backend"),
    ],
)
def test_what_it_cannot_honour_is_refused(tmp_path, arch, kwargs, named):
    from trillm.engine.config_builder import build_config

    path = build_tiny_model(arch, tmp_path / arch)
    with pytest.raises(ValueError, match=rf"numerics='transformers' .*\({named}\)"):
        build_config(EngineArgs(model=str(path), numerics="transformers", **kwargs))


def test_bad_values_are_refused(tmp_path):
    from trillm.engine.config_builder import build_config
    from trillm.entrypoints.cli.main import build_parser
    from trillm.entrypoints.cli.serve_args import engine_kwargs

    with pytest.raises(ValueError, match="numerics must be one of fast, transformers; got 'exact'"):
        EngineArgs(numerics="exact")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--numerics", "exact"])
    given = engine_kwargs(build_parser().parse_args(["serve", "--numerics", "transformers"]))
    assert given["numerics"] == "transformers"
    assert "numerics" not in engine_kwargs(build_parser().parse_args(["serve"]))
    path = build_tiny_model("llama", tmp_path / "m")
    with pytest.raises(ValueError, match="eager attention backend runs on CPU with the KV cache"):
        build_config(EngineArgs(model=str(path), attention_backend="eager", kv_cache_dtype="fp8"))
