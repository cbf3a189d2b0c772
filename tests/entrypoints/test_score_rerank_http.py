"""vLLM's /score (/v1/score) and /rerank (/v1/rerank, /v2/rerank) over HTTP, on a tiny BERT
cross-encoder and a tiny BERT embedding model served without --runner (an encoder pools by
itself): each score equals transformers' (the sigmoid of the pair's logit; the cosine
similarity of the pooled vectors), shapes and usage are vLLM's, /v1/embeddings answers the
openai client, and what is refused is a 4xx in OpenAI's error shape naming the field."""

from __future__ import annotations

import httpx
import pytest
import torch
from bert_reference import hf_embeddings, hf_pair_logits
from server_harness import ServerProcess

from trillm.entrypoints.openai.schemas.protocol import MAX_PROMPTS
from trillm.testing.tiny_bert import build_tiny_encoder, write_pooling_files

KEY = "score-key-51d2"
AUTH = {"Authorization": f"Bearer {KEY}"}
QUERY = "what is the capital of france"
DOCS = ["Paris is the capital of France.", "The weather today is sunny.", "A fox jumps."]
TOL = dict(rtol=0, atol=1e-4)


def _serve(path, log_dir, api_key=None) -> ServerProcess:
    args = ["--model", str(path), "--max-num-batched-tokens", "16", "--disable-log-stats"]
    return ServerProcess(args, log_dir / "server.log", api_key=api_key).start()


@pytest.fixture(scope="module")
def cross_encoder(tmp_path_factory):
    return build_tiny_encoder("BertForSequenceClassification", tmp_path_factory.mktemp("ce"))


@pytest.fixture(scope="module")
def ce_server(cross_encoder, tmp_path_factory):
    srv = _serve(cross_encoder, tmp_path_factory.mktemp("ce-serve"), api_key=KEY)
    yield srv
    assert srv.stop() == 0, srv.log()


@pytest.fixture(scope="module")
def embedder(tmp_path_factory):
    path = build_tiny_encoder("BertModel", tmp_path_factory.mktemp("embed"))
    write_pooling_files(path, "mean", normalize=True)
    return path


@pytest.fixture(scope="module")
def embed_server(embedder, tmp_path_factory):
    srv = _serve(embedder, tmp_path_factory.mktemp("embed-serve"))
    yield srv
    assert srv.stop() == 0, srv.log()


def _post(srv: ServerProcess, path: str, body: dict) -> httpx.Response:
    return httpx.post(srv.url + path, json=body, headers=AUTH, timeout=120)


def _pair_tokens(path, firsts: list[str], seconds: list[str]) -> int:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    return sum(len(tok(a, b)["input_ids"]) for a, b in zip(firsts, seconds, strict=True))


@pytest.mark.parametrize(
    ("text_1", "text_2"),
    [
        ("a fox", "A fox jumps."),  # 1:1
        (QUERY, DOCS),  # 1:N
        (["a fox", "paris", "sunny weather"], DOCS),  # N:N
    ],
)
@pytest.mark.parametrize("path", ["/score", "/v1/score"])
def test_score_equals_the_cross_encoders(ce_server, cross_encoder, path, text_1, text_2):
    seconds = [text_2] if isinstance(text_2, str) else text_2
    firsts = [text_1] * len(seconds) if isinstance(text_1, str) else text_1
    r = _post(ce_server, path, {"text_1": text_1, "text_2": text_2})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "list" and body["id"].startswith("score-")
    assert [d["index"] for d in body["data"]] == list(range(len(seconds)))
    assert {d["object"] for d in body["data"]} == {"score"}
    want = torch.sigmoid(hf_pair_logits(cross_encoder, firsts, seconds))
    torch.testing.assert_close(torch.tensor([d["score"] for d in body["data"]]), want, **TOL)
    tokens = _pair_tokens(cross_encoder, firsts, seconds)
    assert body["usage"] == {
        "prompt_tokens": tokens,
        "total_tokens": tokens,
        "completion_tokens": 0,
        "prompt_tokens_details": None,
    }


@pytest.mark.parametrize("path", ["/rerank", "/v1/rerank", "/v2/rerank"])
def test_rerank_sorts_by_relevance(ce_server, cross_encoder, path):
    r = _post(ce_server, path, {"query": QUERY, "documents": DOCS})
    assert r.status_code == 200, r.text
    body = r.json()
    want = torch.sigmoid(hf_pair_logits(cross_encoder, [QUERY] * 3, DOCS)).tolist()
    order = sorted(range(3), key=lambda i: want[i], reverse=True)
    assert [res["index"] for res in body["results"]] == order
    for res in body["results"]:
        assert res["relevance_score"] == pytest.approx(want[res["index"]], abs=1e-4)
        assert res["document"] == {"text": DOCS[res["index"]]}
    tokens = _pair_tokens(cross_encoder, [QUERY] * 3, DOCS)
    assert body["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens}
    assert body["id"].startswith("rerank-") and body["model"] == str(cross_encoder)


def test_rerank_top_n_and_return_documents(ce_server, cross_encoder):
    body = {"query": QUERY, "documents": DOCS, "top_n": 2, "return_documents": False}
    r = _post(ce_server, "/v1/rerank", body)
    assert r.status_code == 200, r.text
    full = _post(ce_server, "/v1/rerank", {"query": QUERY, "documents": DOCS}).json()
    results = r.json()["results"]
    assert [x["index"] for x in results] == [x["index"] for x in full["results"][:2]]
    assert all("document" not in x for x in results)


def _scores(srv: ServerProcess, route: str, extra: dict) -> list[float]:
    """The scores of QUERY against DOCS, in DOCS' order, from /score or /rerank."""
    if route == "/score":
        r = _post(srv, route, {"text_1": QUERY, "text_2": DOCS, **extra})
        assert r.status_code == 200, r.text
        return [d["score"] for d in r.json()["data"]]
    r = _post(srv, route, {"query": QUERY, "documents": DOCS, **extra})
    assert r.status_code == 200, r.text
    by_index = {x["index"]: x["relevance_score"] for x in r.json()["results"]}
    return [by_index[i] for i in range(len(DOCS))]


@pytest.mark.parametrize("field", ["use_activation", "softmax", "activation"])
@pytest.mark.parametrize("route", ["/score", "/rerank"])
def test_activation_off_gives_the_logit(ce_server, cross_encoder, route, field):
    want = hf_pair_logits(cross_encoder, [QUERY] * 3, DOCS)
    got = torch.tensor(_scores(ce_server, route, {field: False}))
    torch.testing.assert_close(got, want, **TOL)
    on = torch.tensor(_scores(ce_server, route, {field: True}))
    torch.testing.assert_close(on, torch.sigmoid(want), **TOL)


@pytest.mark.parametrize("route", ["/score", "/rerank"])
def test_truncate_prompt_tokens_truncates_the_pair(ce_server, cross_encoder, route):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(cross_encoder)
    model = AutoModelForSequenceClassification.from_pretrained(cross_encoder).eval()
    enc = tok([QUERY] * 3, DOCS, truncation=True, max_length=8, return_tensors="pt")
    with torch.no_grad():
        want = torch.sigmoid(model(**enc).logits[:, 0])
    got = torch.tensor(_scores(ce_server, route, {"truncate_prompt_tokens": 8}))
    torch.testing.assert_close(got, want, **TOL)
    full = torch.sigmoid(hf_pair_logits(cross_encoder, [QUERY] * 3, DOCS))
    assert (full - want).abs().max() > 1e-3  # the truncation changed the scores


@pytest.mark.parametrize(
    ("path", "body", "status", "param"),
    [
        ("/score", {"text_1": ["a", "b"], "text_2": DOCS}, 400, "text_1"),
        ("/score", {"text_1": [], "text_2": DOCS}, 400, "text_1"),
        ("/score", {"text_1": "a", "text_2": ["b"] * (MAX_PROMPTS + 1)}, 400, "text_2"),
        ("/score", {"text_1": "a", "text_2": "b", "model": "another"}, 404, "model"),
        ("/score", {"text_1": "a", "text_2": "b", "mm_processor_kwargs": {}}, 400,
         "mm_processor_kwargs"),
        ("/score", {"text_1": "a", "text_2": "b", "priority": 1}, 400, "priority"),
        ("/score", {"text_1": "a", "text_2": "b" * 10**6}, 400, "text_2"),
        ("/rerank", {"query": "a", "documents": []}, 400, "text_2"),
        ("/rerank", {"query": "a", "documents": ["b"] * (MAX_PROMPTS + 1)}, 400, "documents"),
        ("/rerank", {"query": 7, "documents": ["b"]}, 400, "query"),
        ("/rerank", {"query": "a", "documents": ["b"], "model": "another"}, 404, "model"),
        ("/rerank", {"query": "a", "documents": ["b"], "priority": 1}, 400, "priority"),
        ("/rerank", {"query": "a", "documents": ["b"], "mm_processor_kwargs": {}}, 400,
         "mm_processor_kwargs"),
        ("/v1/completions", {"prompt": "hi"}, 400, "model"),
    ],
)  # fmt: skip
def test_what_the_scoring_routes_refuse(ce_server, path, body, status, param):
    r = _post(ce_server, path, body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["message"], error


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/completions", {"prompt": "hi"}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
    ],
)
def test_an_encoder_refuses_generation_naming_its_task(ce_server, path, body):
    r = _post(ce_server, path, body)
    assert r.status_code == 400, r.text
    message = r.json()["error"]["message"]
    assert "task 'classify'" in message and "encoder-only model: it cannot generate" in message
    assert "/score, /rerank" in message


def test_the_api_key_guards_the_scoring_routes(ce_server):
    for path, body in (
        ("/score", {"text_1": "a", "text_2": "b"}),
        ("/v2/rerank", {"query": "a", "documents": ["b"]}),
    ):
        r = httpx.post(ce_server.url + path, json=body, timeout=60)
        assert r.status_code == 401, r.text


def test_v1_embeddings_on_bert_with_the_openai_client(embed_server, embedder):
    from openai import OpenAI

    texts = [QUERY, *DOCS]
    client = OpenAI(base_url=embed_server.base_url, api_key="none")
    got = client.embeddings.create(model=client.models.list().data[0].id, input=texts)
    vecs = torch.tensor([item.embedding for item in got.data])
    torch.testing.assert_close(vecs, hf_embeddings(embedder, texts, "mean", True), **TOL)


def test_score_and_rerank_with_the_embedding_model(embed_server, embedder):
    vecs = hf_embeddings(embedder, [QUERY, *DOCS], "mean", True)
    want = torch.nn.functional.cosine_similarity(vecs[:1], vecs[1:])
    r = _post(embed_server, "/v1/score", {"text_1": QUERY, "text_2": DOCS})
    assert r.status_code == 200, r.text
    torch.testing.assert_close(torch.tensor([d["score"] for d in r.json()["data"]]), want, **TOL)
    ranked = _post(embed_server, "/rerank", {"query": QUERY, "documents": DOCS}).json()
    assert [x["index"] for x in ranked["results"]] == want.argsort(descending=True).tolist()
    refused = _post(embed_server, "/score", {"text_1": "a", "text_2": "b", "use_activation": False})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "use_activation"
