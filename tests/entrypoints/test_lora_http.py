"""LoRA over HTTP: one real ``trillm serve --enable-lora`` per module, adapters built by PEFT.

A request's ``model`` picks the adapter (completions and chat; the output equals transformers
+ PEFT), an unknown model is a 404 in OpenAI's shape, ``/v1/models`` lists the adapters with
their ``parent``; ``/v1/load_lora_adapter`` / ``/v1/unload_lora_adapter`` exist only with
--allow-runtime-lora-updating (or VLLM_ALLOW_RUNTIME_LORA_UPDATING; 404 without), and check
what they load.
"""

from __future__ import annotations

import json
import shutil
import time

import httpx
import pytest
from server_harness import ServerProcess, open_request, read_until

from trillm.testing.lora_adapters import build_peft_adapter, peft_greedy

BASE = "tiny-base"
PROMPT = "The license grants you the right to"
MAX_NEW = 6


@pytest.fixture(scope="module")
def setup(tiny_model_factory, tmp_path_factory):
    model = tiny_model_factory("qwen2")
    root = tmp_path_factory.mktemp("http-adapters")
    paths = {
        name: str(build_peft_adapter(model, root / name, seed=seed, rank=4))
        for name, seed in (("a", 11), ("b", 12), ("c", 13))
    }
    return model, paths


def _serve(model, paths, log, *extra):
    args = [
        model,
        "--served-model-name",
        BASE,
        "--max-model-len",
        "256",
        "--kv-cache-memory",
        "8MiB",
        "--enable-lora",
        "--max-loras",
        "2",
        "--max-lora-rank",
        "8",
        "--lora-modules",
        f"a={paths['a']}",
        json.dumps({"name": "b", "path": paths["b"], "base_model_name": "someone/else"}),
        *extra,
    ]
    return ServerProcess(args, log).start()


@pytest.fixture(scope="module")
def server(setup, tmp_path_factory):
    model, paths = setup
    srv = _serve(
        model,
        paths,
        tmp_path_factory.mktemp("log") / "lora.log",
        "--allow-runtime-lora-updating",
        "--distributed-executor-backend",
        "uni",
    )
    yield srv
    srv.stop()


def _complete(srv, model, **extra):
    body = {
        "model": model,
        "prompt": PROMPT,
        "max_tokens": MAX_NEW,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
        **extra,
    }
    return httpx.post(srv.base_url + "/completions", json=body, timeout=60)


def test_model_name_selects_the_adapter(setup, server):
    model, paths = setup
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(model).encode(PROMPT)
    outs = {name: _complete(server, name).json() for name in (BASE, "a", "b")}
    for name in ("a", "b"):
        want = peft_greedy(model, paths[name], [ids], MAX_NEW)[0]
        assert outs[name]["choices"][0]["token_ids"] == want, name
        assert outs[name]["model"] == name
    assert outs[BASE]["choices"][0]["token_ids"] != outs["a"]["choices"][0]["token_ids"]
    chat = httpx.post(
        server.base_url + "/chat/completions",
        timeout=60,
        json={
            "model": "a",
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 4,
            "temperature": 0,
        },
    )
    base_chat = httpx.post(
        server.base_url + "/chat/completions",
        timeout=60,
        json={
            "model": BASE,
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 4,
            "temperature": 0,
        },
    )
    assert chat.status_code == 200 and chat.json()["model"] == "a"
    assert chat.json()["choices"][0]["message"] != base_chat.json()["choices"][0]["message"]


def test_tp2_server_mixes_adapters_as_peft(setup, tmp_path):
    """Tensor parallelism (issue 14): a ``-tp 2`` server, adapters "a" and "b" and the base
    model asked at once (one batch): each equals transformers (+ PEFT)."""
    from concurrent.futures import ThreadPoolExecutor

    from hf_reference import hf_greedy
    from transformers import AutoTokenizer

    model, paths = setup
    srv = _serve(model, paths, tmp_path / "tp2.log", "-tp", "2")
    try:
        with ThreadPoolExecutor(3) as pool:
            outs = dict(
                zip(("a", "b", BASE), pool.map(lambda m: _complete(srv, m), ("a", "b", BASE)))
            )
    finally:
        srv.stop()
    ids = AutoTokenizer.from_pretrained(model).encode(PROMPT)
    wants = {name: peft_greedy(model, paths[name], [ids], MAX_NEW)[0] for name in ("a", "b")}
    wants[BASE] = hf_greedy(model, ids, MAX_NEW)
    assert len(set(map(tuple, wants.values()))) == 3  # the adapters change the output
    for name, r in outs.items():
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["token_ids"] == wants[name], name


def _lora_info(srv) -> dict[str, list]:
    """prefix -> the lora_requests_info samples of a /metrics scrape (prometheus_client's
    parser)."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(srv.url + "/metrics", timeout=10).text
    return {
        fam.name.split(":")[0]: fam.samples
        for fam in text_string_to_metric_families(text)
        if fam.name.endswith(":lora_requests_info")
    }


def test_lora_requests_info_names_the_running_adapter(server):
    """vLLM's gauge under both prefixes, with vLLM's labels: "a" while a request of adapter
    "a" streams, no adapter once the client has left."""
    body = {"model": "a", "prompt": PROMPT, "max_tokens": 200, "ignore_eos": True, "stream": True}
    sock = open_request(server, "/v1/completions", body)
    try:
        read_until(sock, b"data: {")  # its first token: it runs
        before = time.time()
        info = _lora_info(server)
        assert set(info) == {"vllm", "trillm"}
        for samples in info.values():
            (sample,) = samples
            assert sample.labels == {
                "max_lora": "2",
                "running_lora_adapters": "a",
                "waiting_lora_adapters": "",
            }
            assert sample.value >= before - 1  # vLLM's value: the time of the stats
    finally:
        sock.close()
    deadline = time.monotonic() + 20
    while _lora_info(server)["vllm"][0].labels["running_lora_adapters"] != "":
        assert time.monotonic() < deadline, "the aborted request still counts"
        time.sleep(0.05)


def test_unknown_model_is_404(server):
    r = _complete(server, "nope")
    assert r.status_code == 404
    err = r.json()["error"]
    assert err["type"] == "NotFoundError" and "nope" in err["message"] and err["param"] == "model"


def test_models_lists_adapters_with_their_parent(server, setup):
    _, paths = setup
    cards = {m["id"]: m for m in httpx.get(server.base_url + "/models").json()["data"]}
    assert set(cards) >= {BASE, "a", "b"}
    assert cards[BASE]["parent"] is None
    assert (cards["a"]["parent"], cards["a"]["root"]) == (BASE, paths["a"])
    assert cards["b"]["parent"] == "someone/else"


def test_load_and_unload_at_runtime(server, setup, tmp_path):
    _, paths = setup
    load, unload = server.base_url + "/load_lora_adapter", server.base_url + "/unload_lora_adapter"
    assert _complete(server, "c").status_code == 404
    r = httpx.post(load, json={"lora_name": "c", "lora_path": paths["c"]})
    assert r.status_code == 200, r.text
    tokens_c = _complete(server, "c").json()["choices"][0]["token_ids"]
    assert tokens_c != _complete(server, "a").json()["choices"][0]["token_ids"]
    again = httpx.post(load, json={"lora_name": "c", "lora_path": paths["c"]})
    assert again.status_code == 400 and "already been loaded" in again.text
    missing = httpx.post(load, json={"lora_name": "d"})
    assert missing.status_code == 400 and "lora_path" in missing.text
    for changes, named in (({"use_dora": True}, "DoRA"), ({"r": 16}, "max_lora_rank=8")):
        bad = httpx.post(
            load, json={"lora_name": "d", "lora_path": _variant(paths["c"], tmp_path, **changes)}
        )
        assert bad.status_code == 400 and named in bad.json()["error"]["message"]
    assert httpx.post(unload, json={"lora_name": "c"}).status_code == 200
    assert _complete(server, "c").status_code == 404
    gone = httpx.post(unload, json={"lora_name": "c"})
    assert gone.status_code == 404 and "cannot be found" in gone.text


def _variant(src: str, tmp_path, **changes) -> str:
    dst = tmp_path / "-".join(changes)
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "adapter_config.json").read_text())
    (dst / "adapter_config.json").write_text(json.dumps({**cfg, **changes}))
    return str(dst)


def test_runtime_updating_routes_need_the_opt_in(setup, tmp_path):
    model, paths = setup
    # The default executor: a worker process, so the adapter crosses the ring with its request.
    srv = _serve(model, paths, tmp_path / "gated.log")
    try:
        r = httpx.post(
            srv.base_url + "/load_lora_adapter", json={"lora_name": "c", "lora_path": paths["c"]}
        )
        assert r.status_code == 404
        from transformers import AutoTokenizer

        ids = AutoTokenizer.from_pretrained(model).encode(PROMPT)
        want = peft_greedy(model, paths["a"], [ids], MAX_NEW)[0]
        assert _complete(srv, "a").json()["choices"][0]["token_ids"] == want
    finally:
        srv.stop()


def test_runtime_updating_env_is_the_flag(monkeypatch):
    from trillm.entrypoints.cli.lora_flags import runtime_updating_allowed

    assert not runtime_updating_allowed(False) and runtime_updating_allowed(True)
    monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "True")
    assert runtime_updating_allowed(False)
    monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "false")
    assert not runtime_updating_allowed(False)


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["--lora-modules", "a=/p"], "--lora-modules: needs --enable-lora"),
        (["--max-loras", "2"], "--max-loras: needs --enable-lora"),
        (["--allow-runtime-lora-updating"], "needs --enable-lora"),
        (["--enable-lora", "--lora-modules", "a=/p", "a=/q"], "given twice"),
        (["--enable-lora", "--lora-modules", "nopath"], "expected name=path"),
        (["--enable-lora", "--lora-modules", '{"name": "a"}'], "needs name and path"),
    ],
)
def test_lora_flags_refused_with_the_flag_named(argv, named, capsys):
    from trillm.entrypoints.cli.lora_flags import check_lora_flags
    from trillm.entrypoints.cli.main import build_parser

    with pytest.raises(SystemExit) as exc:
        args = build_parser().parse_args(["serve", *argv])
        check_lora_flags(args.serve_parser, args)
    assert exc.value.code == 2
    assert named in capsys.readouterr().err
