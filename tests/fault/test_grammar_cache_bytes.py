"""The compiled-grammar cache is bounded in bytes, and one grammar over its share is refused.

Before: the cache kept 512 grammars whatever their size (and xgrammar's own compiler cache,
unbounded, kept them too). A JSON schema of 3,000 optional properties compiles to ~16 MiB;
12 distinct ones took the server from 618 to 1,117 MiB of RSS, and 512 of them allow ~32 GB.

Now ``--structured-outputs-cache-bytes`` (default 512 MiB) bounds the cache, least recently
used out, and a grammar larger than 1/4 of it is a 400 naming the field before it is cached.
A real ``trillm serve`` (fake runner: it samples inside the grammar's bitmask).
"""

from __future__ import annotations

import json
import os

import httpx
import pytest
from server_harness import ServerProcess

CACHE_MIB = 40  # one grammar may take 10 MiB


def schema(tag: str, properties: int) -> dict:
    """A distinct object schema of ``properties`` optional strings (~5 KiB of grammar each),
    in objects of at most 200 (one object may have MAX_SCHEMA_PROPERTIES)."""
    groups = [range(i, min(properties, i + 200)) for i in range(0, properties, 200)]
    return {
        "type": "object",
        "properties": {
            f"{tag}_g{j}": {
                "type": "object",
                "properties": {f"{tag}_{k}": {"type": "string"} for k in group},
            }
            for j, group in enumerate(groups)
        },
    }


def ask(client: httpx.Client, json_schema: dict) -> httpx.Response:
    fmt = {"type": "json_schema", "json_schema": {"name": "s", "schema": json_schema}}
    return client.post(
        "/v1/completions", json={"prompt": "x", "max_tokens": 3, "response_format": fmt}
    )


def tree_rss_mib(pid: int) -> float:
    """VmRSS of ``pid`` and every process below it (the model workers)."""
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        try:
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as f:
                    todo.extend(int(c) for c in f.read().split())
            with open(f"/proc/{p}/status") as f:
                total += next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
        except FileNotFoundError:  # a thread or process gone meanwhile
            continue
    return total / 1024


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log = tmp_path_factory.mktemp("grammar-cache") / "server.log"
    args = ["--runner", "trillm.worker.fake_runner:FakeModelRunner", "--max-model-len", "256"]
    srv = ServerProcess([*args, "--structured-outputs-cache-bytes", f"{CACHE_MIB}MiB"], log)
    yield srv.start()
    assert srv.stop() == 0, srv.log()


def test_distinct_big_schemas_keep_memory_bounded(server):
    # 20 schemas of ~8 MiB of grammar each (~160 MiB in all, ~4x the cache): before the
    # bound the server grew ~20 MiB of RSS per schema (+400 MiB); now the cache holds ~4.
    with httpx.Client(base_url=server.url, timeout=120) as client:
        assert ask(client, schema("warm", 10)).status_code == 200  # xgrammar's tokenizer info
        before = tree_rss_mib(server.proc.pid)
        peak = before
        for i in range(20):
            r = ask(client, schema(f"s{i}", 1500))
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["text"].startswith("{"), r.text
            peak = max(peak, tree_rss_mib(server.proc.pid))
        # The first schema was evicted long ago: compiled again, still served.
        r = ask(client, schema("s0", 1500))
        assert r.status_code == 200 and r.json()["choices"][0]["text"].startswith("{"), r.text
    assert peak - before < 4 * CACHE_MIB, (before, peak)


def test_grammar_over_its_share_is_refused(server):
    # ~10.4 MiB of grammar: more than 1/4 of the 40 MiB cache.
    with httpx.Client(base_url=server.url, timeout=120) as client:
        r = ask(client, schema("big", 2000))
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == "structured_outputs.json", error
        assert "one grammar may take" in error["message"], error
        assert "--structured-outputs-cache-bytes" in error["message"], error
        # the same schema through the other fields: the same refusal
        for body in (
            {"guided_json": schema("big", 2000)},
            {"structured_outputs": {"json": json.dumps(schema("big", 2000))}},
        ):
            r = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 3, **body})
            assert r.status_code == 400 and "one grammar may take" in r.text, r.text
        assert ask(client, schema("small", 50)).status_code == 200  # others still served


def test_cache_evicts_least_recently_used_by_bytes():
    from transformers import AutoTokenizer

    from trillm.structured_output import GrammarCache, GrammarSpec

    tokenizer = AutoTokenizer.from_pretrained("trillm/default_model")
    # ~0.5 MiB a grammar in a 3 MiB cache: it holds five or so of the eight.
    cache = GrammarCache(tokenizer, len(tokenizer), [tokenizer.eos_token_id], cache_bytes=3 << 20)
    try:
        specs = [GrammarSpec("json", json.dumps(schema(f"p{i}", 100))) for i in range(8)]
        for spec in specs[:3]:
            cache.submit(spec).result()
        cache.submit(specs[0])  # used again: now the most recent of the three
        for spec in specs[3:]:
            cache.submit(spec).result()
            assert 0 < cache.cached_bytes <= cache.cache_bytes
        lru_order = [specs[i] for i in (1, 2, 0, 3, 4, 5, 6, 7)]
        cached = [cache.get(spec) is not None for spec in lru_order]
        # some evicted, all of them the least recently used ones
        assert cached[0] is False and cached == sorted(cached), cached
    finally:
        cache.close()


def test_flag_is_validated(capsys):
    from trillm.config import EngineArgs
    from trillm.entrypoints.cli.main import build_parser
    from trillm.entrypoints.cli.serve_args import engine_kwargs

    def kwargs(*flags: str) -> dict:
        return engine_kwargs(build_parser().parse_args(["serve", *flags]))

    assert "structured_outputs_cache_bytes" not in kwargs()  # EngineArgs' default: 512 MiB
    assert kwargs("--structured-outputs-cache-bytes", "64MiB")[
        "structured_outputs_cache_bytes"
    ] == (64 << 20)
    for bad in ("0", "-1", "lots", "1e999"):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["serve", "--structured-outputs-cache-bytes", bad])
        assert "structured_outputs_cache_bytes must be a size > 0" in capsys.readouterr().err
    for bad in (0, -1, "lots", True):
        with pytest.raises(ValueError, match="structured_outputs_cache_bytes must be"):
            EngineArgs(structured_outputs_cache_bytes=bad)


def test_vllm_xgrammar_cache_mb_sets_the_default(monkeypatch):
    from trillm.config import DEFAULT_GRAMMAR_CACHE_BYTES, GRAMMAR_CACHE_ENV, EngineArgs

    monkeypatch.delenv(GRAMMAR_CACHE_ENV, raising=False)
    assert EngineArgs().structured_outputs_cache_bytes == DEFAULT_GRAMMAR_CACHE_BYTES
    monkeypatch.setenv(GRAMMAR_CACHE_ENV, "64")
    assert EngineArgs().structured_outputs_cache_bytes == 64 << 20
    assert EngineArgs(structured_outputs_cache_bytes="8MiB").structured_outputs_cache_bytes == (
        8 << 20
    )  # the argument wins
    for bad in ("0", "-5", "1.5", "lots", ""):
        monkeypatch.setenv(GRAMMAR_CACHE_ENV, bad)
        with pytest.raises(ValueError, match=GRAMMAR_CACHE_ENV):
            EngineArgs()
