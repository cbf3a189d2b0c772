"""The embedded default model: ``trillm serve`` with no MODEL works on a fresh machine, and
the README's client examples work as written against it."""

from __future__ import annotations

import shutil
import subprocess
import sys

import httpx
import pytest
from hf_reference import hf_greedy
from openai import OpenAI
from server_harness import ServerProcess

import trillm.default_model as default_model
from trillm.default_model import DefaultModelMissingError, ensure_default_model, shipped_weights


def test_default_model_ships_trained_weights():
    # The package carries the weights: no build step, no download.
    assert shipped_weights()
    folder = ensure_default_model()
    assert (folder / "model.safetensors").stat().st_size > 1_000_000


def test_an_install_without_the_weights_is_refused_not_served_random(tmp_path, monkeypatch):
    monkeypatch.setattr(default_model, "HERE", tmp_path)
    with pytest.raises(DefaultModelMissingError, match="reinstall trillm, or pass a MODEL"):
        ensure_default_model()


def test_resolving_the_default_model_imports_no_test_helpers():
    code = (
        "import sys; from trillm.model_executor.model_files import resolve_model_path; "
        "resolve_model_path(None); print('trillm.testing' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    trillm_cli = shutil.which("trillm")
    if trillm_cli is None:
        pytest.skip("the trillm console script is installed by `pip install -e .`")
    log = tmp_path_factory.mktemp("default-serve") / "server.log"
    # Exactly as a user types it: no MODEL, no flags beyond where to listen.
    srv = ServerProcess([], log, launcher=[trillm_cli]).start()
    yield srv
    assert srv.stop() == 0


def test_serve_without_a_model_lists_the_default(server):
    models = httpx.get(server.base_url + "/models", timeout=30).json()
    assert [m["id"] for m in models["data"]] == ["trillm-default"]


def test_readme_curl_example(server):
    body = {"model": "trillm-default", "prompt": "In the beginning", "max_tokens": 32}
    resp = httpx.post(server.base_url + "/completions", json=body, timeout=120)
    assert resp.status_code == 200, resp.text
    assert resp.json()["choices"][0]["text"].strip()


def test_readme_openai_example_matches_transformers(server):
    client = OpenAI(base_url=server.base_url, api_key="unused")
    out = client.completions.create(
        model="trillm-default",
        prompt="And God said",
        max_tokens=12,
        temperature=0,
        extra_body={"return_token_ids": True, "ignore_eos": True},
    )
    choice = out.choices[0].model_dump()
    folder = str(ensure_default_model())
    assert choice["token_ids"] == hf_greedy(folder, choice["prompt_token_ids"], 12)
    assert out.choices[0].text.strip()


def test_readme_chat_stream_example(server):
    body = {
        "model": "trillm-default",
        "stream": True,
        "max_tokens": 32,
        "messages": [{"role": "user", "content": "Who created the heaven?"}],
    }
    chunks = []
    with httpx.stream("POST", server.base_url + "/chat/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: "):
                chunks.append(line[6:])
    assert chunks[-1] == "[DONE]" and len(chunks) > 2
