"""SamplingParams fields, EngineArgs fields and ``trillm serve`` flags, each shown to change
what happens through the Python API (``LLM`` on the embedded default model), or refused with a
ValueError / argparse error naming it. Greedy runs compared with the same run without the field.
tests/entrypoints/test_field_coverage.py maps every field and flag to tests like these.
"""

from __future__ import annotations

import json
import re

import pytest
from engine_flag_samples import SERVE_FLAG_SAMPLES

from trillm import LLM, SamplingParams
from trillm.config import EngineArgs
from trillm.entrypoints.cli.main import build_parser
from trillm.entrypoints.cli.serve_args import engine_kwargs, server_options
from trillm.sampling_params import StructuredOutputsParams

PROMPT = "And God said, Let there be light"
EOS, ENDOFTEXT = 2, 0  # <|im_end|> (config.json) and <|endoftext|> (generation_config.json)
CLOSE, COMMA, SPACE = 95, 14, 223  # "}", "," and " " in the default model's vocabulary
SMALL = {"max_model_len": 256, "kv_cache_memory": "16MiB", "distributed_executor_backend": "uni"}


def first_sample(engine: LLM) -> list[int]:
    """An unseeded sampled run: drawn from the engine's global generator (EngineArgs.seed)."""
    out = engine.generate([PROMPT], SamplingParams(max_tokens=12, ignore_eos=True), use_tqdm=False)
    return list(out[0].outputs[0].token_ids)


@pytest.fixture(scope="module")
def llm():
    engine = LLM(None, block_size=8, **SMALL)
    engine.first_sample = first_sample(engine)  # type: ignore[attr-defined]
    yield engine
    engine.shutdown()


def run(engine: LLM, prompt: str = PROMPT, **fields):
    params = SamplingParams(**{"temperature": 0.0, "max_tokens": 8, **fields})
    return engine.generate([prompt], params, use_tqdm=False)[0]


def ids(engine: LLM, **fields) -> list[int]:
    return list(run(engine, **fields).outputs[0].token_ids)


# ---------------------------------------------------------------- SamplingParams


def test_temperature_seed_n(llm):
    greedy = ids(llm, max_tokens=12)
    hot = ids(llm, max_tokens=12, temperature=1.5, seed=1)
    assert hot != greedy and ids(llm, max_tokens=12, temperature=1.5, seed=1) == hot
    assert ids(llm, max_tokens=12, temperature=1.5, seed=2) != hot
    out = run(llm, n=3, temperature=1.0, seed=3, ignore_eos=True)
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1


@pytest.mark.parametrize("only_the_top", [{"top_k": 1}, {"top_p": 1e-6}, {"min_p": 1.0}])
def test_top_k_top_p_min_p_that_keep_one_token_give_the_greedy_output(llm, only_the_top):
    greedy = ids(llm, max_tokens=12)
    hot = {"max_tokens": 12, "temperature": 2.0, "seed": 5}
    assert ids(llm, **hot) != greedy
    assert ids(llm, **hot, **only_the_top) == greedy


@pytest.mark.parametrize(
    "penalty",
    [{"presence_penalty": 2.0}, {"frequency_penalty": 2.0}, {"repetition_penalty": 2.0}],
)
def test_penalties_make_a_repetitive_output_less_repetitive(llm, penalty):
    plain = ids(llm, max_tokens=40, ignore_eos=True)
    assert len(set(plain)) < len(plain)
    penalised = ids(llm, max_tokens=40, ignore_eos=True, **penalty)
    assert len(set(penalised)) > len(set(plain))


def test_logit_bias_allowed_token_ids_bad_words(llm):
    assert ids(llm, logit_bias={300: 100.0}) == [300] * 8
    free = ids(llm)
    allowed = [t for t in range(200, 230) if t not in free]
    assert set(ids(llm, allowed_token_ids=allowed)) <= set(allowed)
    word = llm.get_tokenizer().decode([free[0]]).strip()
    assert ids(llm, bad_words=[word])[0] != free[0]
    with pytest.raises(ValueError, match="allowed_token_ids"):
        ids(llm, allowed_token_ids=[10**6])


def test_stop_stop_token_ids_include_stop_str_in_output(llm):
    out = run(llm, max_tokens=16, ignore_eos=True).outputs[0]
    stop = out.text[len(out.text) // 2 : len(out.text) // 2 + 2]
    cut = run(llm, max_tokens=16, ignore_eos=True, stop=[stop]).outputs[0]
    assert cut.text == out.text[: out.text.find(stop)] and cut.finish_reason == "stop"
    kept = run(llm, max_tokens=16, ignore_eos=True, stop=stop, include_stop_str_in_output=True)
    assert kept.outputs[0].text == out.text[: out.text.find(stop) + len(stop)]
    token = out.token_ids[2]
    by_id = run(llm, max_tokens=16, ignore_eos=True, stop_token_ids=[token]).outputs[0]
    assert list(by_id.token_ids) == list(out.token_ids[: out.token_ids.index(token) + 1])


def test_eos_fields_and_detokenize(llm):
    eos = {"logit_bias": {EOS: 100.0}}
    assert ids(llm, **eos) == [EOS]
    ignored = run(llm, ignore_eos=True, max_tokens=3, **eos).outputs[0]
    assert list(ignored.token_ids) == [EOS] * 3 and ignored.text == ""  # skip_special_tokens
    shown = run(llm, ignore_eos=True, max_tokens=2, skip_special_tokens=False, **eos)
    assert shown.outputs[0].text == "<|im_end|><|im_end|>"
    held = ids(llm, min_tokens=5, **eos)
    assert len(held) == 6 and EOS not in held[:5]
    assert ids(llm, max_tokens=3, ignore_eos=True) == ids(llm, max_tokens=8, ignore_eos=True)[:3]
    silent = run(llm, detokenize=False).outputs[0]
    assert silent.text == "" and list(silent.token_ids) == ids(llm)


def test_logprobs_and_prompt_logprobs(llm):
    out = run(llm, logprobs=2, prompt_logprobs=1)
    sample = out.outputs[0]
    assert len(sample.logprobs) == 8 and all(len(pos) >= 2 for pos in sample.logprobs)
    assert len(out.prompt_logprobs) == len(out.prompt_token_ids) and out.prompt_logprobs[0] is None
    bare = run(llm)
    assert not bare.outputs[0].logprobs and not bare.prompt_logprobs
    with pytest.raises(ValueError, match="logprobs"):
        run(llm, logprobs=21)  # more than max_logprobs (20)


def test_truncate_prompt_tokens(llm):
    whole = run(llm)
    cut = run(llm, truncate_prompt_tokens=3)
    assert list(cut.prompt_token_ids) == list(whole.prompt_token_ids[-3:])
    long = PROMPT * 40  # longer than the context: refused unless truncated
    with pytest.raises(ValueError):
        run(llm, prompt=long)
    assert len(run(llm, prompt=long, truncate_prompt_tokens=16).prompt_token_ids) == 16


DIGIT = {
    "type": "object",
    "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["n"],
}


@pytest.mark.parametrize(
    ("so", "bias", "valid"),
    [
        ({"choice": ["alpha", "beta"]}, None, lambda t: t in ("alpha", "beta")),
        ({"regex": "[ab]{4}x"}, None, lambda t: re.fullmatch("[ab]{4}x", t)),
        ({"grammar": 'root ::= "yes" | "no"'}, None, lambda t: t in ("yes", "no")),
        (
            {"json": DIGIT, "disable_any_whitespace": True, "disable_additional_properties": True},
            None,
            lambda t: set(json.loads(t)) == {"n"},
        ),
        ({"json_object": True}, CLOSE, lambda t: json.loads(t) == {}),
        (
            {
                "structural_tag": {
                    "type": "structural_tag",
                    "format": {"type": "const_string", "value": "fixed"},
                }
            },
            None,
            lambda t: t == "fixed",
        ),
    ],
)
def test_structured_outputs_kinds(llm, so, bias, valid):
    fields = {"max_tokens": 64, "structured_outputs": StructuredOutputsParams(**so)}
    if bias is not None:
        fields["logit_bias"] = {bias: 30.0}
    out = run(llm, **fields).outputs[0]
    assert out.finish_reason == "stop" and valid(out.text), out.text


def test_disable_any_whitespace_and_disable_additional_properties(llm):
    def text(bias: int, **options) -> str:
        so = StructuredOutputsParams(json=DIGIT, **options)
        return (
            run(llm, max_tokens=24, logit_bias={bias: 8.0}, structured_outputs=so).outputs[0].text
        )

    def canonical(t: str) -> bool:  # xgrammar's fixed separators (", ", ": ") and no more
        try:
            return t == json.dumps(json.loads(t))
        except ValueError:
            return False

    assert not canonical(text(SPACE))  # the model favours spaces, and the grammar allows them
    assert canonical(text(SPACE, disable_any_whitespace=True))
    # Favouring ",": no property follows "n" with or without disable_additional_properties,
    # since xgrammar compiles schemas strictly (as vLLM's xgrammar backend): the option's
    # constraint always holds (see NO_EFFECT_BY_DESIGN in test_field_coverage.py).
    for options in ({}, {"disable_additional_properties": True}):
        assert set(json.loads(text(COMMA, disable_any_whitespace=True, **options))) == {"n"}
    loose = {
        "type": "object",
        "properties": {"n": {"type": "integer"}},
        "required": ["n"],
        "additionalProperties": True,
    }
    so = StructuredOutputsParams(
        json=loose, disable_any_whitespace=True, disable_additional_properties=True
    )
    free = run(llm, max_tokens=24, logit_bias={COMMA: 8.0}, structured_outputs=so).outputs[0]
    assert "," in free.text  # what the schema says wins: more properties may follow


# ---------------------------------------------------------------- EngineArgs


def test_engine_args_reach_the_config():
    from trillm.engine.config_builder import build_config

    args = EngineArgs(
        block_size=32,
        max_num_seqs=7,
        max_num_batched_tokens=100,
        long_prefill_token_threshold=5,
        enable_prefix_caching=False,
        scheduling_policy="priority",
        kv_cache_memory="3MiB",
        gpu_memory_utilization=0.5,
        num_gpu_blocks_override=11,
        max_logprobs=3,
        seed=9,
        attention_backend="torch",
        distributed_executor_backend="uni",
        max_model_len=100,
        dtype="float32",
        served_model_name="named",
        device="cpu",
        generation_config="vllm",
    )
    config = build_config(args)
    assert (config.cache.block_size, config.cache.enable_prefix_caching) == (32, False)
    assert config.cache.kv_cache_memory == 3 << 20 and config.cache.gpu_memory_utilization == 0.5
    assert config.cache.num_gpu_blocks_override == 11
    s = config.scheduler
    assert (s.max_num_seqs, s.max_num_batched_tokens, s.long_prefill_token_threshold) == (7, 100, 5)
    assert (s.policy, s.max_model_len) == ("priority", 100)
    assert (config.max_logprobs, config.seed, config.device) == (3, 9, "cpu")
    assert (config.attention_backend, config.parallel.distributed_executor_backend) == (
        "torch",
        "uni",
    )
    m = config.model
    assert (m.dtype, m.served_model_name, m.generation_config) == ("float32", "named", {})
    default = build_config(EngineArgs())
    assert default.model.eos_token_ids == [2, 0]  # generation_config auto
    assert default.scheduler.max_num_batched_tokens == 2048  # vLLM's CPU server default


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"block_size": 24}, "block_size"),
        ({"max_num_seqs": 0}, "max_num_seqs"),
        ({"device": "tpu"}, "device"),
        ({"dtype": "int3"}, "int3"),
        ({"model": "/no/such/folder"}, "/no/such/folder"),  # FileNotFoundError: an OSError
        ({"tensor_parallel_size": 3}, "tensor_parallel_size=3 does not divide"),  # 2 KV heads
    ],
)
def test_engine_args_that_cannot_be_honoured_are_refused(kwargs, words):
    from trillm.engine.config_builder import build_config

    with pytest.raises((ValueError, OSError), match=words):
        build_config(EngineArgs(**kwargs))
    with pytest.raises(TypeError, match="not_an_arg"):
        EngineArgs.from_kwargs(None, not_an_arg=1)


def test_block_size_sets_the_prefix_cache_granularity(llm):
    prompt = " ".join(f"w{i}" for i in range(14))
    n = len(run(llm, prompt=prompt).prompt_token_ids)
    cached = run(llm, prompt=prompt).num_cached_tokens
    # whole blocks of 8, never the last prompt token; not a multiple of the default 16
    assert cached == (n - 1) // 8 * 8 and cached % 16 != 0


@pytest.fixture(scope="module")
def custom(tmp_path_factory):
    template = "{% for m in messages %}<<{{ m.content }}>>{% endfor %}"
    engine = LLM(
        None,
        seed=6,
        chat_template=template,
        max_logprobs=3,
        block_size=16,
        scheduling_policy="priority",
        enable_prefix_caching=False,
        num_gpu_blocks_override=20,
        generation_config="vllm",
        **SMALL,
    )
    engine.first_sample = first_sample(engine)  # type: ignore[attr-defined]
    yield engine
    engine.shutdown()


def test_too_few_kv_blocks_for_the_context_are_refused_at_startup():
    from trillm.worker.kv_cache_sizing import KVCacheTooSmallError

    with pytest.raises(KVCacheTooSmallError, match="6 blocks"):
        LLM(None, num_gpu_blocks_override=6, **SMALL)  # 96 tokens < max_model_len 256


def test_engine_seed_sets_unseeded_sampling(llm, custom):
    again = LLM(None, **SMALL)  # seed 0, as llm
    try:
        assert first_sample(again) == llm.first_sample
    finally:
        again.shutdown()
    assert custom.first_sample != llm.first_sample  # seed 6


def test_engine_args_act_on_requests(llm, custom):
    out = custom.chat(
        [{"role": "user", "content": "x"}], SamplingParams(max_tokens=1), use_tqdm=False
    )[0]
    assert out.prompt == "<<x>>"  # chat_template
    with pytest.raises(ValueError, match="max_logprobs=3"):
        run(custom, logprobs=4)
    assert run(llm, logprobs=4).outputs[0].logprobs
    prompt = " ".join(f"w{i}" for i in range(14))
    run(custom, prompt=prompt)
    assert run(custom, prompt=prompt).num_cached_tokens == 0  # enable_prefix_caching=False
    # num_gpu_blocks_override: the KV cache has that many blocks (else sized by memory)
    assert custom.engine.num_blocks == 20 and llm.engine.num_blocks != 20
    # generation_config: "auto" reads its extra EOS (<|endoftext|>); "vllm" ignores the file
    end = {"logit_bias": {ENDOFTEXT: 100.0}, "max_tokens": 4}
    assert ids(llm, **end) == [ENDOFTEXT]
    assert ids(custom, **end) == [ENDOFTEXT] * 4


# ---------------------------------------------------------------- trillm serve flags


@pytest.mark.parametrize("flag", sorted(SERVE_FLAG_SAMPLES))
def test_engine_flags_reach_the_engine(flag):
    value, field, expected = SERVE_FLAG_SAMPLES[flag]
    argv = ["serve", flag] + ([value] if value is not None else [])
    kwargs = engine_kwargs(build_parser().parse_args(argv))
    assert kwargs[field] == expected
    kwargs.pop("runner", None)
    EngineArgs.from_kwargs(None, **kwargs)  # every other name is an EngineArgs field


def test_model_positional_and_flag_and_bad_values(monkeypatch, capsys):
    import trillm.entrypoints.openai.api_server as api_server
    from trillm.entrypoints.cli.serve_args import run_serve

    seen = {}

    async def fake_run_server(model, engine_args, opts):
        seen.update(model=model, engine_args=engine_args, opts=opts)
        return 0

    monkeypatch.setattr(api_server, "run_server", fake_run_server)
    assert run_serve(build_parser().parse_args(["serve", "/models/a"])) == 0  # MODEL
    assert seen["model"] == "/models/a"
    assert run_serve(build_parser().parse_args(["serve", "--model", "/models/b"])) == 0
    assert seen["model"] == "/models/b"
    for argv, words in (
        (["--tensor-parallel-size", "0"], "--tensor-parallel-size"),
        (["--kv-cache-memory", "lots"], "kv-cache-memory"),
        (["--timeout-keep-alive", "0"], "positive number of seconds"),
        (["--max-num-queued-requests", "-1"], "max-num-queued-requests"),
        (["--scheduling-policy", "lifo"], "scheduling-policy"),
        (["--device", "tpu"], "device"),
        (["--distributed-executor-backend", "mpi"], "distributed-executor-backend"),
        (["--log-level", "loud"], "log-level"),
    ):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["serve", *argv])
        assert words in capsys.readouterr().err, argv


def test_tool_flags_are_checked_at_startup(capsys):
    def options(*flags: str):
        return server_options(build_parser().parse_args(["serve", *flags]))

    opts = options(
        "--enable-auto-tool-choice",
        "--tool-call-parser",
        "hermes",
        "--reasoning-parser",
        "qwen3",
        "--exclude-tools-when-tool-choice-none",
    )
    assert opts.enable_auto_tool_choice and opts.tool_call_parser == "hermes"
    assert opts.reasoning_parser == "qwen3" and opts.exclude_tools_when_tool_choice_none
    for flags, words in (
        (("--enable-auto-tool-choice",), "--tool-call-parser"),
        (("--tool-call-parser", "nope"), "nope"),
        (("--reasoning-parser", "nope"), "nope"),
        (("--tool-parser-plugin", "/no/such/plugin.py"), "plugin"),
    ):
        with pytest.raises(SystemExit):
            options(*flags)
        assert words in str(capsys.readouterr().err), flags


def test_revision_reaches_the_hub_download(monkeypatch, tmp_path):
    import huggingface_hub

    from trillm.model_executor.model_files import resolve_model_path

    asked = {}

    def fake_download(repo_id, revision=None, **kwargs):
        asked.update(repo_id=repo_id, revision=revision)
        return str(tmp_path)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_download)
    assert resolve_model_path("org/model", "v2") == tmp_path
    assert asked == {"repo_id": "org/model", "revision": "v2"}


def test_gpu_memory_utilization_sizes_the_cuda_kv_budget(monkeypatch):
    import torch

    from trillm.engine.config_builder import build_config
    from trillm.worker.kv_cache_sizing import cuda_budget

    total = 80 << 30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (total - (2 << 30), total))

    def budget(fraction: float) -> int:
        from trillm.distributed.sharding import RankShapes

        config = build_config(EngineArgs(gpu_memory_utilization=fraction, device="cpu"))
        shapes = RankShapes.of(config.model, 0, 1)
        return cuda_budget(config, "cuda:0", shapes)

    assert budget(0.9) - budget(0.5) == int(total * 0.9) - int(total * 0.5)
    assert budget(0.01) == 0  # less than what is in use: no room, refused at startup


def test_unknown_attention_backend_is_refused_at_startup():
    with pytest.raises(ValueError, match="attention backend 'nope'"):
        LLM(None, attention_backend="nope", **SMALL)


SHOUTING = '''from transformers import PreTrainedTokenizerFast


class ShoutingTokenizer(PreTrainedTokenizerFast):
    """A tokenizer class shipped with the checkpoint (remote code): decodes in upper case."""

    def decode(self, *args, **kwargs):
        return super().decode(*args, **kwargs).upper()
'''


def test_trust_remote_code_lets_the_tokenizers_code_run(tmp_path):
    from trillm.testing.tiny_models import DEFAULT_MODEL_DIR

    folder = tmp_path / "remote-tokenizer"
    folder.mkdir()
    (folder / "tokenizer.json").write_bytes((DEFAULT_MODEL_DIR / "tokenizer.json").read_bytes())
    config = json.loads((DEFAULT_MODEL_DIR / "tokenizer_config.json").read_text())
    config.update(
        tokenizer_class="ShoutingTokenizer",
        auto_map={"AutoTokenizer": [None, "shouting.ShoutingTokenizer"]},
    )
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    (folder / "shouting.py").write_text(SHOUTING)
    with pytest.raises(ValueError, match="trust_remote_code"):
        LLM(None, tokenizer=str(folder), **SMALL)
    engine = LLM(None, tokenizer=str(folder), trust_remote_code=True, **SMALL)
    try:
        tok = engine.get_tokenizer()
        assert type(tok).__name__ == "ShoutingTokenizer" and tok.decode(tok.encode("hi")) == "HI"
        assert ids(engine)  # and it serves
    finally:
        engine.shutdown()


def test_tls_client_certificates_and_cors_methods_reach_the_server(tmp_path, capsys):
    """--ssl-ca-certs / --ssl-cert-reqs reach hypercorn's TLS config; --allowed-methods the
    CORS layer (the rest of TLS and CORS: tests/entrypoints/test_vllm_flags.py, on a real server)."""
    import ssl
    import types

    import trio

    from trillm.entrypoints.cli import vllm_flags
    from trillm.entrypoints.openai.http.deployment import configure_hypercorn, wrap_asgi

    files = {name: tmp_path / f"{name}.pem" for name in ("key", "cert", "ca")}
    for path in files.values():
        path.write_text("-")
    argv = [
        "serve",
        "--ssl-keyfile",
        str(files["key"]),
        "--ssl-certfile",
        str(files["cert"]),
        "--ssl-ca-certs",
        str(files["ca"]),
        "--ssl-cert-reqs",
        "2",
        "--allowed-methods",
        '["GET"]',
    ]
    opts = server_options(build_parser().parse_args(argv))
    config = types.SimpleNamespace()
    configure_hypercorn(config, opts)
    assert config.ca_certs == str(files["ca"]) and config.verify_mode == ssl.CERT_REQUIRED

    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    def preflight(method: str) -> int:
        sent = []

        async def send(message):
            sent.append(message)

        async def receive():
            return {"type": "http.request", "body": b""}

        headers = [
            (b"origin", b"https://a.example"),
            (b"access-control-request-method", method.encode()),
        ]
        scope = {"type": "http", "method": "OPTIONS", "path": "/v1/models", "headers": headers}
        trio.run(wrap_asgi(app, opts), scope, receive, send)
        return sent[0]["status"]

    assert (preflight("GET"), preflight("POST")) == (200, 400)
    args = build_parser().parse_args(["serve", "--ssl-ca-certs", str(tmp_path / "none.pem")])
    with pytest.raises(SystemExit):
        vllm_flags.check_flags(args.serve_parser, args)
    assert "--ssl-ca-certs" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--ssl-cert-reqs", "3"])


def test_spaces_between_special_tokens():
    """False (vLLM's rule): an added token right after another is its bare content. Seen with
    a decoder that spaces tokens (WordPiece, through the DecodeStream fallback); the decoders
    trillm models concatenate added tokens, so there both settings give the same text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from trillm.engine.output_processor import OutputProcessor
    from trillm.messages import EngineCoreOutput, FinishReason

    backend = Tokenizer(models.WordPiece({"[UNK]": 0, "hello": 1, "world": 2}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.decoder = decoders.WordPiece()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]")
    tok.add_special_tokens({"additional_special_tokens": ["[A]", "[B]"]})
    ids = tok.convert_tokens_to_ids(["world", "[A]", "[B]", "world"])

    def text(**fields) -> str:
        processor = OutputProcessor(tok)
        params = SamplingParams(skip_special_tokens=False, **fields)
        collector = processor.add_request("r", None, [1], params)
        out = EngineCoreOutput(request_id="r", new_token_ids=ids, finish_reason=FinishReason.LENGTH)
        processor.process_outputs([out])
        return collector.get_nowait().outputs[0].text

    assert text() == " world [A] [B] world"  # after the prompt "hello"
    assert text(spaces_between_special_tokens=False) == " world [A][B] world"


def test_enforce_eager_reaches_the_runner_from_the_serve_flag():
    # vLLM's default (False) replays small CPU decode steps (tests/worker/test_step_program.py);
    # --enforce-eager turns that off in the runner's config.
    from trillm.engine.config_builder import build_config
    from trillm.entrypoints.cli.main import build_parser
    from trillm.entrypoints.cli.serve_args import engine_kwargs

    given = engine_kwargs(build_parser().parse_args(["serve", "--enforce-eager"]))
    assert given["enforce_eager"] is True
    assert build_config(EngineArgs(**given)).enforce_eager is True
    assert "enforce_eager" not in engine_kwargs(build_parser().parse_args(["serve"]))
    assert build_config(EngineArgs()).enforce_eager is False
