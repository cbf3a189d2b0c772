"""``vllm serve``'s commonly set flags on ``trillm serve`` (issue 16): each accepted with vLLM's
meaning, accepted and said once in the log where trillm has no such mechanism, or refused with
an error naming it (features of other open issues); ``--config FILE.yaml``; TLS, CORS,
``--root-path``, request and stats logs and the SageMaker / load endpoints on a real server."""

from __future__ import annotations

import datetime
import json
import os
import ssl
import subprocess
import sys
import time

import httpx
import openai
import pytest
from server_harness import REPO, ServerProcess, free_port

from trillm.entrypoints.cli.main import build_parser

FAKE = ["--runner", "trillm.worker.fake_runner:FakeModelRunner"]

# vLLM's 35 most-set `vllm serve` flags (issue 16) with a typical value.
TOP35_ACCEPTED = [
    ["--host", "0.0.0.0"],
    ["--port", "8001"],
    ["--model", "m"],
    ["--served-model-name", "a"],
    ["--max-model-len", "4096"],
    ["--dtype", "bfloat16"],
    ["--tensor-parallel-size", "1"],
    ["--gpu-memory-utilization", "0.85"],
    ["--max-num-seqs", "64"],
    ["--max-num-batched-tokens", "8192"],
    ["--enable-prefix-caching"],
    ["--api-key", "k"],
    ["--chat-template", "t.jinja"],
    ["--trust-remote-code"],
    ["--seed", "1"],
    ["--block-size", "16"],
    ["--uvicorn-log-level", "warning"],
    ["--generation-config", "vllm"],
    ["--tokenizer", "tok"],
    ["--enable-chunked-prefill"],
    ["--enforce-eager"],
    ["--enable-auto-tool-choice"],
    ["--tool-call-parser", "hermes"],
    ["--reasoning-parser", "qwen3"],
    ["--disable-log-requests"],
    ["--swap-space", "4"],
    ["--load-format", "safetensors"],
    ["--download-dir", "/tmp/x"],
    ["--enable-lora"],
    ["--lora-modules", "a=/p"],
    ["--data-parallel-size", "2"],
    ["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}'],
    [
        "--speculative-config",
        '{"method": "draft_model", "model": "m", "num_speculative_tokens": 3}',
    ],
    ["--pipeline-parallel-size", "2"],
]
# Features of other open issues: refused with the flag named, never accepted and ignored.
TOP35_REFUSED = [
    ["--quantization", "awq_marlin"],
    ["--kv-cache-dtype", "fp8_e5m2"],
    ["--speculative-config", '{"method": "medusa", "model": "m", "num_speculative_tokens": 3}'],
]


def parse(*argv: str):
    return build_parser().parse_args(["serve", *argv])


@pytest.mark.parametrize("argv", TOP35_ACCEPTED, ids=lambda a: a[0])
def test_top35_flag_accepted(argv):
    args = parse(*argv)
    assert args.func.__name__ == "run_serve"


@pytest.mark.parametrize("argv", TOP35_REFUSED, ids=lambda a: a[0])
def test_top35_flag_of_another_issue_refused(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        parse(*argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert argv[0] in err and "not implemented yet" in err, err


# More vLLM flags deployments set: accepted (said once where moot) or refused by name.
MORE_ACCEPTED = [
    ["--disable-uvicorn-access-log"],
    ["--enable-prompt-tokens-details"],
    ["--max-seq-len-to-capture", "8192"],
    ["--disable-custom-all-reduce"],
    ["--tokenizer-mode", "auto"],
    ["--enable-server-load-tracking"],
    ["--disable-log-stats"],
    ["--enable-log-requests"],
]
MORE_REFUSED = [
    ["--tokenizer-mode", "mistral"],
    ["--data-parallel-size-local", "2"],
    ["--data-parallel-start-rank", "1"],
    ["--data-parallel-address", "10.0.0.1"],
    ["--data-parallel-rpc-port", "13345"],
    ["--data-parallel-backend", "ray"],
    ["--data-parallel-hybrid-lb"],
    ["--data-parallel-external-lb"],
]


@pytest.mark.parametrize("argv", MORE_ACCEPTED, ids=lambda a: a[0])
def test_more_vllm_flags_accepted(argv):
    assert parse(*argv).func.__name__ == "run_serve"


@pytest.mark.parametrize("argv", MORE_REFUSED, ids=lambda a: a[0])
def test_more_vllm_flags_refused(argv, capsys):
    with pytest.raises(SystemExit):
        parse(*argv)
    err = capsys.readouterr().err
    assert argv[0] in err and "not implemented yet" in err, err


def test_top35_table_is_35_flags():
    assert len({a[0] for a in TOP35_ACCEPTED + TOP35_REFUSED}) == 35


@pytest.mark.parametrize(
    "argv",
    [
        ["--load-format", "pt"],
        ["--quantization", "fp4"],
        ["--no-enable-chunked-prefill"],
        ["--allowed-origins", "*"],
        ["--swap-space", "-1"],
        ["--log-stats-interval", "0"],
        ["--max-loras", "0"],
        ["--ssl-keyfile", "/nonexistent.pem"],
        ["--root-path", "api"],
        ["--ssl-cert-reqs", "2"],
    ],
    ids=lambda a: a[0],
)
def test_bad_values_refused_with_the_flag_named(argv, capsys):
    from trillm.entrypoints.cli import vllm_flags

    with pytest.raises(SystemExit) as exc:
        args = parse(*argv)
        vllm_flags.check_flags(args.serve_parser, args)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert argv[0].replace("--no-", "--") in err.replace("--no-", "--"), err


def test_value_one_is_the_no_op_for_parallel_sizes():
    args = parse("-pp", "1", "-dp", "1", "--kv-cache-dtype", "auto", "--load-format", "auto")
    assert (args.pipeline_parallel_size, args.data_parallel_size) == (1, 1)


def test_moot_flags_say_so_once():
    from trillm.entrypoints.cli.vllm_flags import startup_notes

    notes = startup_notes(
        parse(
            "--enforce-eager",
            "--swap-space",
            "4",
            "--enable-chunked-prefill",
            "--disable-log-requests",
            "--max-seq-len-to-capture",
            "8",
            "--disable-custom-all-reduce",
            "--enable-prompt-tokens-details",  # honoured (test_vllm_conformance): no note
        )
    )
    assert [n.split(":")[0] for n in notes] == [
        "--enable-chunked-prefill",
        "--enforce-eager",
        "--swap-space 4",
        "--disable-log-requests",
        "--max-seq-len-to-capture",
        "--disable-custom-all-reduce",
    ]
    assert startup_notes(parse()) == []


def test_config_yaml_and_command_line_precedence(tmp_path, capsys):
    cfg = tmp_path / "serve.yaml"
    cfg.write_text(
        "model: org/from-file\nmax-model-len: 128\nmax_num_seqs: 8\nenforce-eager: true\n"
        "enable-prefix-caching: false\nallowed-origins: ['https://a.example']\n"
        "served-model-name: [x, y]\nport: 9001\n"
    )
    args = parse("--max-model-len", "64", "--config", str(cfg), "--port", "9002")
    assert args.max_model_len == 64  # given before --config: the command line wins
    assert args.port == 9002  # after it: wins too
    assert args.max_num_seqs == 8 and args.enforce_eager is True
    assert args.enable_prefix_caching is False
    assert args.allowed_origins == ["https://a.example"]
    assert args.served_model_name == ["x", "y"]
    assert args.config_model == "org/from-file" and not (args.model_opt or args.model_tag)
    args = parse("org/cli", "--config", str(cfg))
    assert args.model_tag == "org/cli"  # the command line's MODEL is served
    bad = tmp_path / "bad.yaml"
    bad.write_text("max-modle-len: 3\n")
    with pytest.raises(SystemExit):
        parse("--config", str(bad))
    assert "unknown option 'max-modle-len'" in capsys.readouterr().err
    bad.write_text("max-model-len: many\n")
    with pytest.raises(SystemExit):
        parse("--config", str(bad))
    assert "--max-model-len" in capsys.readouterr().err


def test_download_dir_is_the_hub_cache(tmp_path):
    """A hub id resolves from --download-dir's hub-cache layout (offline, in a subprocess so
    the environment change stays there)."""
    snapshot = tmp_path / "dl" / "models--org--tiny" / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text("{}")
    (tmp_path / "dl" / "models--org--tiny" / "refs").mkdir()
    (tmp_path / "dl" / "models--org--tiny" / "refs" / "main").write_text("abc123")
    code = (
        "from trillm.entrypoints.cli.vllm_flags import apply_download_dir\n"
        "from trillm.model_executor.model_files import resolve_model_path\n"
        f"apply_download_dir({str(tmp_path / 'dl')!r})\n"
        "import os; print(resolve_model_path('org/tiny')); print(os.environ['HF_HUB_CACHE'])\n"
    )
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=str(REPO))
    env.pop("HF_HUB_CACHE", None)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    path, cache = out.stdout.split()
    assert path == str(snapshot) and cache == str(tmp_path / "dl")


# ---------------------------------------------------------------- a real server

ORIGIN = "https://app.example"
KEY = "sk-flags"
SECRET = "the-secret-prompt-" + "x" * 100


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log = tmp_path_factory.mktemp("vllm-flags") / "server.log"
    srv = ServerProcess(
        [
            *FAKE,
            "--allowed-origins",
            json.dumps([ORIGIN]),
            "--allow-credentials",
            "--allowed-headers",
            '["authorization", "content-type"]',
            "--log-stats-interval",
            "0.5",
            "--enforce-eager",
            "--swap-space",
            "4",
            "--root-path",
            "/proxy",
        ],
        log,
        api_key=KEY,
    ).start()
    yield srv
    assert srv.stop() == 0, srv.log()


def test_preflight_needs_no_api_key_and_names_what_is_disallowed(server):
    url = server.base_url + "/chat/completions"
    ok = httpx.options(
        url,
        headers={
            "Origin": ORIGIN,
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization",
        },
    )
    assert ok.status_code == 200
    assert ok.headers["access-control-allow-origin"] == ORIGIN
    assert ok.headers["access-control-allow-credentials"] == "true"
    assert "POST" in ok.headers["access-control-allow-methods"]
    assert "authorization" in ok.headers["access-control-allow-headers"]
    bad = httpx.options(
        url,
        headers={
            "Origin": "https://evil.example",
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "x-custom",
        },
    )
    assert bad.status_code == 400 and bad.text == "Disallowed CORS origin, headers"


def test_cors_headers_on_answers_and_errors(server):
    models = httpx.get(server.base_url + "/models", headers={"Origin": ORIGIN, **server.headers()})
    assert models.status_code == 200
    assert models.headers["access-control-allow-origin"] == ORIGIN
    assert models.headers["vary"] == "Origin"
    denied = httpx.get(server.base_url + "/models", headers={"Origin": ORIGIN})
    assert denied.status_code == 401 and denied.headers["access-control-allow-origin"] == ORIGIN
    other = httpx.get(
        server.base_url + "/models", headers={"Origin": "https://evil.example", **server.headers()}
    )
    assert other.status_code == 200 and "access-control-allow-origin" not in other.headers
    body = {"prompt": "hi", "max_tokens": 3, "stream": True}
    with httpx.stream(
        "POST",
        server.base_url + "/completions",
        json=body,
        headers={"Origin": ORIGIN, **server.headers()},
    ) as stream:
        assert stream.headers["access-control-allow-origin"] == ORIGIN
        assert b"[DONE]" in stream.read()


@pytest.mark.parametrize("prefix", ["", "/proxy"])
def test_root_path_serves_paths_with_and_without_it(server, prefix):
    # vLLM's (FastAPI's root_path): with or without the prefix, behind the same key.
    client = openai.OpenAI(base_url=f"{server.url}{prefix}/v1", api_key=KEY, max_retries=0)
    model = client.models.list().data[0].id
    chat = {"model": model, "messages": [{"role": "user", "content": "hi"}]}
    assert client.chat.completions.create(**chat, max_tokens=2).choices[0].message.content
    with pytest.raises(openai.AuthenticationError):
        client.with_options(api_key="wrong").chat.completions.create(**chat, max_tokens=2)
    # (the prefix is stripped once, and only as whole segments)
    for path in ("/proxy/proxy/v1/models", "/proxyv1/models"):
        assert httpx.get(server.url + path, headers=server.headers()).status_code == 404


def test_ping_load_and_invocations(server):
    assert httpx.get(server.url + "/ping").status_code == 200
    assert httpx.post(server.url + "/ping").status_code == 200
    auth = server.headers()  # /load and /invocations need the key like /v1 (/ping does not)
    assert httpx.get(server.url + "/load").status_code == 401
    assert httpx.get(server.url + "/load", headers=auth).json() == {"server_load": 0}
    chat = httpx.post(
        server.url + "/invocations",
        timeout=60,
        headers=auth,
        json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3},
    )
    assert chat.status_code == 200 and chat.json()["object"] == "chat.completion"
    completion = httpx.post(
        server.url + "/invocations",
        json={"prompt": SECRET, "max_tokens": 3},
        headers=auth,
        timeout=60,
    )
    assert completion.status_code == 200 and completion.json()["object"] == "text_completion"
    bad = httpx.post(server.url + "/invocations", json={"input": "hi"}, headers=auth)
    assert bad.status_code == 400 and "'messages'" in bad.json()["error"]["message"]
    models = httpx.get(server.base_url + "/models", headers=server.headers()).json()
    assert models["object"] == "list" and models["data"][0]["object"] == "model"


def test_load_counts_requests_in_flight(server):
    # A stream counts until its last byte is sent (vLLM's rule): one larger than the socket
    # buffers, left unread, is still being sent.
    body = {"prompt": "hi", "max_tokens": 1500, "ignore_eos": True, "logprobs": 20, "stream": True}
    with httpx.stream(
        "POST", server.base_url + "/completions", json=body, headers=server.headers(), timeout=60
    ) as stream:
        chunks = stream.iter_bytes()  # (kept: a dropped iterator closes the connection)
        first = next(chunks)
        assert stream.status_code == 200, first
        assert load(server) >= 1
    deadline = time.monotonic() + 10
    while load(server) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert load(server) == 0


def load(server: ServerProcess) -> int:
    return httpx.get(server.url + "/load", headers=server.headers()).json()["server_load"]


def test_logs_stats_notes_once_and_no_prompt_by_default(server):
    httpx.post(
        server.base_url + "/completions",
        json={"prompt": SECRET, "max_tokens": 4},
        headers=server.headers(),
        timeout=60,
    )
    deadline = time.monotonic() + 10
    while "Avg generation throughput" not in server.log() and time.monotonic() < deadline:
        time.sleep(0.2)
    log = server.log_path.read_text()
    assert SECRET[:18] not in log  # prompts are never logged unless asked
    stats = [line for line in log.splitlines() if "Avg prompt throughput" in line]
    assert stats and "Running: " in stats[0] and "KV cache usage: " in stats[0]
    assert "Prefix cache hit rate: " in stats[0]
    assert log.count("--enforce-eager: small CPU decode steps run eagerly") == 1
    assert log.count("--swap-space 4: ") == 1


# ---------------------------------------------------------------- TLS and request logs


def _self_signed(tmp_path):
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.UTC)
    import ipaddress

    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
        .sign(key, hashes.SHA256())
    )
    key_file, cert_file = tmp_path / "key.pem", tmp_path / "cert.pem"
    key_file.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return key_file, cert_file


def test_tls_and_request_log(tmp_path):
    key_file, cert_file = _self_signed(tmp_path)
    port = free_port()
    log_path = tmp_path / "server.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "trillm",
                "serve",
                *FAKE,
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--ssl-keyfile",
                str(key_file),
                "--ssl-certfile",
                str(cert_file),
                "--enable-log-requests",
                "--max-log-len",
                "24",
                "--disable-log-stats",
                "--log-level",
                "debug",
                "--disable-uvicorn-access-log",
            ],
            cwd=REPO,
            env=dict(os.environ, PYTHONPATH=str(REPO)),
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    url = f"https://127.0.0.1:{port}"
    try:
        with httpx.Client(
            verify=ssl.create_default_context(cafile=str(cert_file)), timeout=60
        ) as client:
            deadline = time.monotonic() + 120
            while True:
                assert proc.poll() is None, log_path.read_text()
                try:
                    if client.get(url + "/health").status_code == 200:
                        break
                except httpx.HTTPError:
                    assert time.monotonic() < deadline, log_path.read_text()
                    time.sleep(0.25)
            with pytest.raises(httpx.HTTPError):
                httpx.get(f"http://127.0.0.1:{port}/health", timeout=5)  # plain HTTP: no
            r = client.post(
                url + "/v1/completions", json={"prompt": SECRET, "max_tokens": 3, "temperature": 0}
            )
            assert r.status_code == 200, r.text
            with client.stream(
                "POST",
                url + "/v1/chat/completions",
                json={
                    "messages": [{"role": "user", "content": "streamed"}],
                    "max_tokens": 2,
                    "stream": True,
                },
            ) as stream:
                stream.read()
    finally:
        proc.terminate()
        assert proc.wait(60) == 0
    log = log_path.read_text()
    received = [line for line in log.splitlines() if "Received request" in line]
    assert len(received) == 2, log
    assert f"prompt: '{SECRET[:24]}... ({len(SECRET)} characters)'" in received[0]
    assert SECRET[:30] not in log  # truncated to --max-log-len
    assert '"temperature":0' in received[0] and '"max_tokens":3' in received[0]
    finished = [line for line in log.splitlines() if "Finished request" in line]
    assert len(finished) == 2 and "'length'" in finished[0] and "stream ended" in finished[1]
    assert "Avg prompt throughput" not in log  # --disable-log-stats
    assert "hypercorn.access" not in log  # --disable-uvicorn-access-log, even at debug


# ---------------------------------------------------------------- units


def test_stats_line_info_after_activity_debug_when_idle():
    import logging

    from server_harness import stats_engine

    from trillm.entrypoints.openai.metrics.prometheus import ServerMetrics
    from trillm.entrypoints.openai.metrics.stats_logger import StatsLine
    from trillm.messages import SchedulerStats

    stats = SchedulerStats(num_running_reqs=3, num_waiting_reqs=1, kv_cache_usage=0.25)
    engine = stats_engine([stats])
    metrics = ServerMetrics(engine, "m")
    line = StatsLine(engine, metrics, now=0.0)
    metrics.per_engine[0].prompt_tokens.value += 100
    metrics.per_engine[0].generation_tokens.value += 50
    stats.prefix_cache_queries, stats.prefix_cache_hits = 200, 50
    level, message = line.line(10.0)
    assert level == logging.INFO
    assert message == (
        "Engine 000: Avg prompt throughput: 10.0 tokens/s, Avg generation throughput: 5.0 "
        "tokens/s, Running: 3 reqs, Waiting: 1 reqs, KV cache usage: 25.0%, Prefix cache hit "
        "rate: 25.0%"
    )
    assert line.line(20.0)[0] == logging.INFO  # the interval after activity still shows
    level, message = line.line(30.0)  # two idle intervals: no noise
    assert level == logging.DEBUG and "Avg prompt throughput: 0.0 tokens/s" in message


def test_cors_rules():
    import trio

    from trillm.entrypoints.openai.http.cors import CORSMiddleware

    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    def call(mw, method, headers):
        sent = []

        async def send(message):
            sent.append(message)

        async def receive():
            return {"type": "http.request", "body": b""}

        scope = {
            "type": "http",
            "method": method,
            "path": "/v1/models",
            "headers": [(k.encode(), v.encode()) for k, v in headers.items()],
        }
        trio.run(mw, scope, receive, send)
        return sent[0]["status"], dict(sent[0]["headers"])

    open_mw = CORSMiddleware(app, ["*"], ["*"], ["*"])
    status, headers = call(open_mw, "GET", {"origin": "https://x.example"})
    assert headers[b"access-control-allow-origin"] == b"*"
    # A credentialed request (cookie) never gets "*": the origin itself, and Vary.
    status, headers = call(open_mw, "GET", {"origin": "https://x.example", "cookie": "a=b"})
    assert headers[b"access-control-allow-origin"] == b"https://x.example"
    assert headers[b"vary"] == b"Origin"
    assert call(open_mw, "GET", {})[1] == {}  # no Origin: untouched
    strict = CORSMiddleware(app, ["https://a.example"], ["GET"], ["x-key"], True)
    preflight = {"origin": "https://a.example", "access-control-request-method": "POST"}
    status, _ = call(strict, "OPTIONS", preflight)
    assert status == 400  # POST not allowed
    preflight["access-control-request-method"] = "GET"
    preflight["access-control-request-headers"] = "X-Key"
    status, headers = call(strict, "OPTIONS", preflight)
    assert status == 200 and headers[b"access-control-allow-credentials"] == b"true"
    assert headers[b"access-control-allow-methods"] == b"GET"
    assert b"x-key" in headers[b"access-control-allow-headers"]
