"""vLLM's multimodal cache series in /metrics (``vllm:mm_cache_queries`` / ``_hits``, in items,
and their ``trillm:`` twins) count the frontend's processed-image cache over HTTP: a repeated
image is a hit, another image a miss, a text-only request no query. ``--skip-mm-profiling``
is accepted and said once in the server's log."""

from __future__ import annotations

import httpx
import openai
import pytest
from llava_reference import data_url, image, png
from server_harness import ServerProcess, metric_value

NAME = "tiny-llava"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from trillm.testing.tiny_llava import build_tiny_llava

    path = str(build_tiny_llava(tmp_path_factory.mktemp("tiny-llava-metrics")))
    log = tmp_path_factory.mktemp("server-mm-metrics") / "server.log"
    args = [path, "--served-model-name", NAME, "--max-model-len", "128"]
    args += ["--kv-cache-memory", "4MiB", "--distributed-executor-backend", "uni"]
    args += ["--skip-mm-profiling", "--mm-processor-cache-gb", "0.5"]
    srv = ServerProcess(args, log).start()
    yield srv
    assert srv.stop() == 0, srv.log()


def counts(srv: ServerProcess, prefix: str = "vllm:") -> tuple[float, float]:
    text = httpx.get(srv.url + "/metrics", timeout=10).text
    return (
        metric_value(text, prefix + "mm_cache_queries_total"),
        metric_value(text, prefix + "mm_cache_hits_total"),
    )


def ask(client: openai.OpenAI, seed: int | None) -> str:
    content: list[dict] = [{"type": "text", "text": "What is it?"}]
    if seed is not None:
        url = data_url(png(image(seed)))
        content.insert(0, {"type": "image_url", "image_url": {"url": url}})
    out = client.chat.completions.create(
        model=NAME,
        messages=[{"role": "user", "content": content}],
        max_tokens=3,
        temperature=0.0,
    )
    return str(out.choices[0].message.content)


def test_a_repeated_image_is_a_hit_in_metrics(server):
    assert counts(server) == (0.0, 0.0)  # the series exist before any image
    client = openai.OpenAI(base_url=server.base_url, api_key="none", max_retries=0)
    first = ask(client, 0)
    assert counts(server) == (1.0, 0.0)
    assert ask(client, 0) == first
    assert counts(server) == (2.0, 1.0)
    ask(client, 1)
    ask(client, None)  # no image: no query
    assert counts(server) == counts(server, "trillm:") == (3.0, 1.0)


def test_skip_mm_profiling_is_said_in_the_log(server):
    assert "skip_mm_profiling: trillm runs no memory-profiling pass at start" in server.log()
