"""``trillm serve --dtype float16`` on CPU (vLLM's CPU build serves it): a completion's greedy
text equals transformers' fp16 model's on the same tiny checkpoint, and the log says what fp16
stores and computes in."""

from __future__ import annotations

import httpx
import pytest
import torch
from server_harness import ServerProcess

MAX_NEW = 8
PROMPT = [5, 900, 17, 2044, 311, 48, 77]


def _hf_fp16_text(path: str) -> str:
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float16).eval()
    gen = transformers.GenerationConfig(
        do_sample=False, max_new_tokens=MAX_NEW, eos_token_id=None, pad_token_id=0
    )
    with torch.no_grad():
        out = hf.generate(torch.tensor([PROMPT]), generation_config=gen)
    tok = transformers.AutoTokenizer.from_pretrained(path)
    return tok.decode(out[0, len(PROMPT) :].tolist())


@pytest.fixture(scope="module")
def server(tiny_model_factory, tmp_path_factory):
    args = [tiny_model_factory("llama"), "--dtype", "float16", "--max-model-len", "256"]
    args += ["--kv-cache-memory", "8MiB", "--distributed-executor-backend", "uni"]
    srv = ServerProcess(args, tmp_path_factory.mktemp("fp16") / "server.log").start()
    yield srv
    assert srv.stop() == 0, srv.log()


def test_completion_equals_transformers_float16(server, tiny_model_factory):
    body = {"prompt": PROMPT, "max_tokens": MAX_NEW, "temperature": 0.0, "ignore_eos": True}
    r = httpx.post(server.base_url + "/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == _hf_fp16_text(tiny_model_factory("llama"))
    assert "dtype float16 on CPU" in server.log()
