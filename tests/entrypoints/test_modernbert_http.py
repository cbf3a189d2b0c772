"""ModernBERT served over HTTP without --runner (an encoder pools by itself): a tiny
``ModernBertModel``'s /v1/embeddings through the official openai client, and a tiny
``ModernBertForSequenceClassification`` (mean pooling) on /rerank, each equal to transformers'
on prompts longer than its 8-token window."""

from __future__ import annotations

import httpx
import pytest
import torch
from bert_reference import hf_embeddings, hf_pair_logits
from server_harness import ServerProcess

from trillm.testing.tiny_bert import build_tiny_modernbert, write_pooling_files

QUERY = "what is the capital of france"
DOCS = [
    "Paris is the capital of France.",
    "The weather today is sunny.",
    "A fox jumps over the lazy dog in the sunny weather today.",
]
TOL = dict(rtol=0, atol=1e-4)


def _serve(path, log_dir) -> ServerProcess:
    args = ["--model", str(path), "--max-num-batched-tokens", "16", "--disable-log-stats"]
    return ServerProcess(args, log_dir / "server.log").start()


def test_v1_embeddings_with_the_openai_client(tmp_path):
    from openai import OpenAI

    path = build_tiny_modernbert("ModernBertModel", tmp_path / "model")
    write_pooling_files(path, "mean", normalize=True)
    srv = _serve(path, tmp_path)
    try:
        texts = [QUERY, *DOCS]
        client = OpenAI(base_url=srv.base_url, api_key="none")
        got = client.embeddings.create(model=client.models.list().data[0].id, input=texts)
    finally:
        assert srv.stop() == 0, srv.log()
    vecs = torch.tensor([item.embedding for item in got.data])
    torch.testing.assert_close(vecs, hf_embeddings(path, texts, "mean", True), **TOL)


def test_rerank_with_the_cross_encoder(tmp_path):
    path = build_tiny_modernbert(
        "ModernBertForSequenceClassification", tmp_path / "model", seed=3,
        classifier_pooling="mean",
    )  # fmt: skip
    srv = _serve(path, tmp_path)
    try:
        r = httpx.post(srv.url + "/rerank", json={"query": QUERY, "documents": DOCS}, timeout=120)
    finally:
        assert srv.stop() == 0, srv.log()
    assert r.status_code == 200, r.text
    want = torch.sigmoid(hf_pair_logits(path, [QUERY] * 3, DOCS)).tolist()
    results = r.json()["results"]
    assert [res["index"] for res in results] == sorted(range(3), key=lambda i: -want[i])
    for res in results:
        assert res["relevance_score"] == pytest.approx(want[res["index"]], abs=1e-4)
