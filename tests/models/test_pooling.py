"""Pooling models (embeddings): ``runner="pooling"`` on a tiny Llama checkpoint, against
transformers' final hidden states pooled by hand (sentence-transformers' definitions): MEAN,
LAST and CLS, normalized or not, prompts split over several prefill chunks; the Python API
(``LLM.embed``) and a real ``trillm serve --runner pooling`` (``/v1/embeddings`` with the
official client, float and base64, ``/pooling``); and what is refused."""

from __future__ import annotations

import base64
import json
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest
import torch
from server_harness import ServerProcess, open_request, wait_gauges
from shared_servers import FAKE_256, FAKE_256_GROUP

from trillm import LLM
from trillm.config import PoolerConfig, PoolingConfigError, check_runner
from trillm.model_executor.pooling import resolve_pooler
from trillm.testing.tiny_models import build_tiny_model

TEXTS = [
    "the quick brown fox jumps over the lazy dog and keeps running far away",
    "hi",
    "a third, medium-length input",
]


def _st_files(path, mode: str | None, normalize: bool) -> None:
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"}
    ]
    if mode is not None:
        modules.append(
            {
                "idx": 1,
                "name": "1",
                "path": "1_Pooling",
                "type": "sentence_transformers.models.Pooling",
            }
        )
        (path / "1_Pooling").mkdir(exist_ok=True)
        (path / "1_Pooling" / "config.json").write_text(json.dumps({mode: True}))
    if normalize:
        modules.append(
            {
                "idx": 2,
                "name": "2",
                "path": "2_Normalize",
                "type": "sentence_transformers.models.Normalize",
            }
        )
    (path / "modules.json").write_text(json.dumps(modules))


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = build_tiny_model("llama", tmp_path_factory.mktemp("embed"))
    _st_files(path, "pooling_mode_mean_tokens", normalize=True)
    return path


@pytest.fixture(scope="module")
def hf(model):
    from transformers import AutoModel, AutoTokenizer

    return AutoTokenizer.from_pretrained(model), AutoModel.from_pretrained(model).eval()


def reference(hf, text: str, kind: str, normalize: bool) -> tuple[list[int], np.ndarray]:
    tok, m = hf
    ids = tok(text, return_tensors="pt").input_ids
    with torch.no_grad():
        hidden = m(ids).last_hidden_state[0]  # [T, H]: after the final norm
    vec = {"MEAN": hidden.mean(0), "LAST": hidden[-1], "CLS": hidden[0]}[kind]
    if normalize:
        vec = torch.nn.functional.normalize(vec, dim=-1)
    return ids[0].tolist(), vec.numpy()


# ---------------------------------------------------------------- configuration


def test_the_folder_says_how_to_pool_and_an_override_wins(tmp_path):
    assert resolve_pooler(str(tmp_path), None, {}) == PoolerConfig("LAST", True)  # no ST files
    for key, kind in [
        ("pooling_mode_mean_tokens", "MEAN"),
        ("pooling_mode_lasttoken", "LAST"),
        ("pooling_mode_cls_token", "CLS"),
    ]:
        _st_files(tmp_path, key, normalize=False)
        assert resolve_pooler(str(tmp_path), None, {}) == PoolerConfig(kind, False)
    override = {"pooling_type": "cls", "normalize": True}
    assert resolve_pooler(str(tmp_path), override, {}) == PoolerConfig("CLS", True)
    assert resolve_pooler(str(tmp_path), None, {"is_matryoshka": True}).matryoshka


@pytest.mark.parametrize(
    "args,match",
    [
        (("draft", "auto", None), "speculative"),
        (("generate", "embed", None), "contradicts"),
        (("auto", "reward", None), "reward"),
        (("pooling", "auto", {"pooling_type": "MAX"}), "pooling_type"),
        (("pooling", "auto", {"softmax": True}), "softmax"),
        (("pooling", "auto", {"normalize": "yes"}), "normalize"),
    ],
)
def test_settings_trillm_cannot_honour_are_refused(args, match):
    with pytest.raises(PoolingConfigError, match=match):
        check_runner(*args)


@pytest.mark.parametrize(
    "extra",
    [
        {"enable_lora": True},
        {"speculative_config": {"method": "ngram", "num_speculative_tokens": 2}},
    ],
)
def test_pooling_with_what_its_runner_does_not_do_is_refused(model, extra):
    from trillm.config import EngineArgs
    from trillm.engine.config_builder import build_config

    name = next(iter(extra))
    with pytest.raises(ValueError, match=name):
        build_config(EngineArgs(model=str(model), runner="pooling", **extra))


def test_an_unsupported_sentence_transformers_mode_is_refused(tmp_path):
    _st_files(tmp_path, "pooling_mode_max_tokens", normalize=False)
    with pytest.raises(PoolingConfigError, match="pooling_mode_max_tokens"):
        resolve_pooler(str(tmp_path), None, {})


# ---------------------------------------------------------------- Python API


@pytest.mark.parametrize(
    "override",
    [
        None,
        {"pooling_type": "LAST", "normalize": False},
        {"pooling_type": "CLS", "normalize": True},
    ],
)
def test_llm_embed_equals_transformers(model, hf, override):
    kind, normalize = (
        ("MEAN", True) if override is None else (override["pooling_type"], override["normalize"])
    )
    llm = LLM(
        str(model),
        runner="pooling",
        pooler_config=override,
        max_num_batched_tokens=16,
        distributed_executor_backend="uni",
    )
    try:
        outs = llm.embed(TEXTS, use_tqdm=False)  # the first text needs two prefill chunks
        with pytest.raises(ValueError, match="pooling model"):
            llm.generate("hello", use_tqdm=False)
    finally:
        llm.shutdown()
    assert len(outs[0].prompt_token_ids) > 16
    for text, out in zip(TEXTS, outs, strict=True):
        ids, want = reference(hf, text, kind, normalize)
        assert out.prompt_token_ids == ids
        np.testing.assert_allclose(out.outputs.embedding, want, rtol=1e-4, atol=1e-5)


def test_pp2_embeds_as_transformers_does(model, hf):
    """Pipeline parallelism (issue 14): stage 0 runs layer 0 and hands its hidden states on;
    the last stage pools (mean, normalized) what its final norm gives, in prefill chunks."""
    with LLM(
        str(model),
        runner="pooling",
        pipeline_parallel_size=2,
        max_num_batched_tokens=16,
        max_model_len=128,
        kv_cache_memory="8MiB",
    ) as llm:
        outs = llm.embed(TEXTS, use_tqdm=False)
    for text, out in zip(TEXTS, outs, strict=True):
        ids, want = reference(hf, text, "MEAN", True)
        assert out.prompt_token_ids == ids
        np.testing.assert_allclose(out.outputs.embedding, want, rtol=1e-4, atol=1e-5)


@pytest.fixture(scope="module")
def tp1_embeddings(model) -> list[np.ndarray]:
    with LLM(
        str(model),
        runner="pooling",
        max_num_batched_tokens=16,
        max_model_len=128,
        kv_cache_memory="8MiB",
        distributed_executor_backend="uni",
    ) as llm:
        return [np.asarray(o.outputs.embedding) for o in llm.embed(TEXTS, use_tqdm=False)]


# The ranks' all-reduces add the partial sums in another order than one rank's GEMM: the
# vectors agree to a few float32 ulps, not bit for bit.
TP_TOLERANCE = dict(rtol=1e-5, atol=1e-6)


def test_tp2_embeds_as_tp1_does(model, hf, tp1_embeddings):
    """Tensor parallelism (issue 14): every rank's final norm sees the whole hidden states
    (o_proj / down_proj all-reduced), so each pools the same vector; prompts in 16-token
    chunks."""
    with LLM(
        str(model),
        runner="pooling",
        tensor_parallel_size=2,
        max_num_batched_tokens=16,
        max_model_len=128,
        kv_cache_memory="8MiB",
    ) as llm:
        outs = llm.embed(TEXTS, use_tqdm=False)
    for text, out, want in zip(TEXTS, outs, tp1_embeddings, strict=True):
        assert out.prompt_token_ids == reference(hf, text, "MEAN", True)[0]
        np.testing.assert_allclose(out.outputs.embedding, want, **TP_TOLERANCE)


def test_tp2_v1_embeddings_over_http_as_tp1(model, tp1_embeddings, tmp_path):
    srv = ServerProcess(
        [
            "--model",
            str(model),
            "--runner",
            "pooling",
            "-tp",
            "2",
            "--max-num-batched-tokens",
            "16",
            "--max-model-len",
            "128",
            "--kv-cache-memory",
            "8MiB",
            "--disable-log-stats",
        ],
        tmp_path / "server.log",
    ).start()
    try:
        r = httpx.post(srv.base_url + "/embeddings", json={"input": TEXTS}, timeout=60)
    finally:
        assert srv.stop() == 0, srv.log()
    assert r.status_code == 200, r.text
    got = _vectors("/v1/embeddings", r.json())
    for vec, want in zip(got, tp1_embeddings, strict=True):
        np.testing.assert_allclose(vec, want, **TP_TOLERANCE)


def test_convert_embed_is_the_pooling_runner(model, hf):
    llm = LLM(str(model), convert="embed", distributed_executor_backend="uni")
    try:
        (out,) = llm.embed([TEXTS[1]], use_tqdm=False)
    finally:
        llm.shutdown()
    np.testing.assert_allclose(
        out.outputs.embedding, reference(hf, TEXTS[1], "MEAN", True)[1], rtol=1e-4, atol=1e-5
    )


def test_a_generative_engine_refuses_to_embed(model):
    llm = LLM(str(model), distributed_executor_backend="uni")
    try:
        with pytest.raises(ValueError, match="runner='pooling'"):
            llm.embed("hello", use_tqdm=False)
    finally:
        llm.shutdown()


# ---------------------------------------------------------------- HTTP


@pytest.fixture(scope="module")
def server(model, tmp_path_factory):
    log = tmp_path_factory.mktemp("embed-serve") / "server.log"
    srv = ServerProcess(
        [
            "--model",
            str(model),
            "--runner",
            "pooling",
            "--max-num-batched-tokens",
            "16",
            "--disable-log-stats",
        ],
        log,
    ).start()
    yield srv
    assert srv.stop() == 0, srv.log()


def test_v1_embeddings_with_the_openai_client(server, hf):
    from openai import OpenAI

    client = OpenAI(base_url=server.base_url, api_key="none")
    got = client.embeddings.create(model=client.models.list().data[0].id, input=TEXTS)
    total = 0
    for i, (text, item) in enumerate(zip(TEXTS, got.data, strict=True)):
        ids, want = reference(hf, text, "MEAN", True)
        assert item.index == i
        np.testing.assert_allclose(item.embedding, want, rtol=1e-4, atol=1e-5)
        total += len(ids)
    assert got.usage.prompt_tokens == got.usage.total_tokens == total
    b64 = client.embeddings.create(model=got.model, input=TEXTS[1], encoding_format="base64")
    raw = base64.b64decode(b64.data[0].embedding)  # asked for base64: the client leaves it
    np.testing.assert_allclose(np.frombuffer(raw, "<f4"), got.data[1].embedding, rtol=1e-6)


def _vectors(route: str, body: dict) -> list[np.ndarray]:
    key = "data" if route == "/pooling" else "embedding"
    out = []
    for item in body["data"]:
        assert item["object"] == ("pooling" if route == "/pooling" else "embedding")
        value = item[key]
        if isinstance(value, str):  # base64: float32 little-endian bytes
            value = np.frombuffer(base64.b64decode(value), "<f4")
        out.append(np.asarray(value))
    return out


ROUTES = ["/v1/embeddings", "/pooling"]


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("encoding", ["float", "base64"])
def test_token_id_input_and_encoding_format(server, hf, route, encoding):
    ids, want = reference(hf, TEXTS[2], "MEAN", True)
    r = httpx.post(server.url + route, json={"input": ids, "encoding_format": encoding}, timeout=60)
    assert r.status_code == 200, r.text
    (got,) = _vectors(route, r.json())
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("route", ROUTES)
def test_truncate_prompt_tokens_keeps_the_last_tokens(server, hf, route):
    ids, _ = reference(hf, TEXTS[0], "MEAN", True)
    r = httpx.post(
        server.url + route, json={"input": TEXTS[0], "truncate_prompt_tokens": 5}, timeout=60
    )
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == 5
    whole = httpx.post(server.url + route, json={"input": ids[-5:]}, timeout=60).json()
    np.testing.assert_allclose(_vectors(route, r.json())[0], _vectors(route, whole)[0], rtol=1e-6)


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize(
    "body,status,param",
    [
        ({"input": "x", "dimensions": 8}, 400, "dimensions"),
        ({"input": []}, 400, "input"),
        ({"input": [10**9]}, 400, "input"),
        ({"input": "x", "model": "another"}, 404, "model"),
    ],
)
def test_what_the_pooling_routes_refuse(server, route, body, status, param):
    r = httpx.post(server.url + route, json=body, timeout=60)
    assert r.status_code == status, r.text
    assert r.json()["error"]["param"] == param


@pytest.mark.parametrize(
    "path,body",
    [
        ("/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
        ("/completions", {"prompt": "hi"}),
    ],
)
def test_a_pooling_server_refuses_generation(server, path, body):
    r = httpx.post(server.base_url + path, json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "model" and "pooling" in r.json()["error"]["message"]


@pytest.mark.xdist_group(FAKE_256_GROUP)  # a generating server that other modules share
def test_a_generating_server_refuses_embeddings(shared_server):
    srv = shared_server(FAKE_256)  # (the pool checks that it exits with 0 at the end)
    r = httpx.post(srv.base_url + "/embeddings", json={"input": "hi"}, timeout=60)
    classify = httpx.post(srv.url + "/classify", json={"input": "hi"}, timeout=60)
    assert r.status_code == 400 and "--runner pooling" in r.json()["error"]["message"]
    assert classify.status_code == 400 and "sequence classifier" in classify.text


# ---------------------------------------------------------------- the queue bound

# Two inputs fill the two places (--max-num-seqs 1, --max-num-queued-requests 1). Each takes
# five prefill chunks of 16 tokens, whichever the engine gets first: once the gauges first
# show one running and one waiting, both stay held for four more steps (2 s).
HOLDING = {"input": [" ".join(["fox"] * 25)] * 2}


@pytest.fixture(scope="module")
def slow_server(model, tmp_path_factory):
    """The pooling model, each step 0.5 s slower; two sequences admitted at once."""
    (model / "slow_runner.json").write_text(json.dumps({"step_sleep_s": 0.5}))
    log = tmp_path_factory.mktemp("embed-queue") / "server.log"
    srv = ServerProcess(
        [
            "--model",
            str(model),
            "--convert",
            "embed",
            "--runner",
            "trillm.testing.slow_runner:SlowPoolingRunner",
            "--max-num-seqs",
            "1",
            "--max-num-queued-requests",
            "1",
            "--max-num-batched-tokens",
            "16",
            "--disable-log-stats",
        ],
        log,
    ).start()
    yield srv
    assert srv.stop() == 0, srv.log()


def _refused_as_overloaded(r: httpx.Response) -> None:
    # What a generation request gets from a full queue (tests/fault/test_lifecycle_faults.py).
    assert r.status_code == 503, r.text
    assert r.headers["Retry-After"] == "1"
    assert r.json()["error"]["type"] == "ServiceUnavailableError"
    assert "overloaded" in r.json()["error"]["message"]


def test_embedding_inputs_hold_queue_places_until_done(slow_server):
    """While a request's two inputs hold both places any pooling request is refused at once
    with the generation routes' 503; once it is answered the places are free again."""
    with ThreadPoolExecutor(1) as pool:
        first = pool.submit(
            httpx.post, slow_server.base_url + "/embeddings", json=HOLDING, timeout=60
        )
        wait_gauges(slow_server, (1.0, 1.0))  # one input in its prefill, one waiting
        for route in ROUTES:
            start = time.monotonic()
            _refused_as_overloaded(
                httpx.post(slow_server.url + route, json={"input": "x"}, timeout=60)
            )
            assert time.monotonic() - start < 1.0
        r = first.result()
    assert r.status_code == 200, r.text
    assert len(r.json()["data"]) == 2
    again = httpx.post(slow_server.url + "/pooling", json={"input": ["a", "b"]}, timeout=60)
    assert again.status_code == 200, again.text


def test_a_client_gone_frees_its_embedding_places(slow_server):
    sock = open_request(slow_server, "/pooling", HOLDING)
    wait_gauges(slow_server, (1.0, 1.0))
    _refused_as_overloaded(
        httpx.post(slow_server.base_url + "/embeddings", json={"input": "x"}, timeout=60)
    )
    sock.close()
    wait_gauges(slow_server, (0.0, 0.0))  # the engine aborted both inputs
    r = httpx.post(slow_server.base_url + "/embeddings", json={"input": ["a", "b"]}, timeout=60)
    assert r.status_code == 200, r.text
