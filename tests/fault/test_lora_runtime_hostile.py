"""Runtime LoRA loading (``--allow-runtime-lora-updating``) against hostile names and paths.

Before: a 4 MiB ``lora_name`` was served and echoed in every chunk's ``model``; an unknown
4 MiB ``model`` came back whole in the 404; an adapter folder whose ``adapter_config.json`` is
a FIFO hung the load, and then SIGTERM never ended the server; the errors told which paths
exist (Errno 2 vs 20); relative and ``..`` paths were tried as given. Now names are bounded
like request ids, every path that is not a loadable adapter (under ``--lora-allowed-root``
when given) gets one answer, and the adapter's files are read as regular files only.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import threading
import time
from pathlib import Path

import httpx
import pytest
import trio
from server_harness import ServerProcess

from trillm.entrypoints.openai.endpoints import lora
from trillm.entrypoints.openai.endpoints.lora import (
    MAX_LORA_NAME_CHARS,
    NOT_AN_ADAPTER,
    LoRARegistry,
)
from trillm.entrypoints.openai.http.errors import BadRequestError
from trillm.testing.lora_adapters import build_peft_adapter

HUGE = 4 << 20  # a 4 MiB name


@pytest.fixture(scope="module")
def adapters(tiny_model_factory, tmp_path_factory):
    """The model, and adapter folders: inside the allowed root a good one, a FIFO config, a
    symlink to an adapter outside; outside the root a good one."""
    model = tiny_model_factory("qwen2")
    base = tmp_path_factory.mktemp("lora-hostile")
    root, outside = base / "allowed", base / "outside"
    good = build_peft_adapter(model, root / "good", seed=3, rank=4)
    shutil.copytree(good, outside / "good")
    (root / "fifo").mkdir()
    shutil.copy(good / "adapter_model.safetensors", root / "fifo")
    os.mkfifo(root / "fifo" / "adapter_config.json")
    (root / "escape").symlink_to(outside / "good")
    return {
        "model": model,
        "root": root,
        "good": good,
        "outside": outside / "good",
        "fifo": root / "fifo",
        "escape": root / "escape",
    }


def _serve(adapters, log, *extra: str) -> ServerProcess:
    args = [
        adapters["model"],
        "--runner",
        "trillm.worker.fake_runner:FakeModelRunner",
        "--max-model-len",
        "256",
        "--enable-lora",
        "--max-lora-rank",
        "8",
        "--allow-runtime-lora-updating",
        *extra,
    ]
    return ServerProcess(args, log).start()


@pytest.fixture(scope="module")
def server(adapters, tmp_path_factory):
    log = tmp_path_factory.mktemp("log") / "server.log"
    srv = _serve(adapters, log, "--lora-allowed-root", str(adapters["root"]))
    yield srv
    assert srv.stop() == 0, srv.log()


def _load(srv: ServerProcess, name: str, path: str, timeout: float = 20) -> httpx.Response:
    body = {"lora_name": name, "lora_path": path}
    return httpx.post(srv.base_url + "/load_lora_adapter", json=body, timeout=timeout)


def test_long_names_are_refused_and_not_echoed(server, adapters):
    r = _load(server, "n" * HUGE, str(adapters["good"]))
    assert r.status_code == 400, r.text[:300]
    assert r.json()["error"]["param"] == "lora_name" and len(r.content) < 1000
    gone = httpx.post(
        server.base_url + "/unload_lora_adapter", json={"lora_name": "n" * HUGE}, timeout=20
    )
    assert gone.status_code == 400 and len(gone.content) < 1000
    longest = "n" * MAX_LORA_NAME_CHARS
    assert _load(server, longest, str(adapters["good"])).status_code == 200
    body = {"model": longest, "prompt": "hi", "max_tokens": 3}
    assert (
        httpx.post(server.base_url + "/completions", json=body, timeout=60).json()["model"]
        == longest
    )
    unload = {"lora_name": longest}
    assert httpx.post(server.base_url + "/unload_lora_adapter", json=unload).status_code == 200


def test_unknown_long_model_is_not_echoed_whole(server):
    body = {"model": "m" * HUGE, "prompt": "hi", "max_tokens": 3}
    r = httpx.post(server.base_url + "/completions", json=body, timeout=60)
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"
    assert len(r.content) < 2000


def test_paths_that_are_not_adapters_get_one_answer(server, adapters):
    """Missing, not a folder, relative, ``..``, a NUL, outside the root (directly or through a
    symlink), a folder without an adapter: the same 400, which names no errno."""
    paths = [
        "/etc/passwd",
        "/nonexistent/x",
        "relative/path",
        "/tmp/../etc",
        "/etc\0passwd",
        str(adapters["outside"]),
        str(adapters["escape"]),
        str(adapters["root"]),
        str(adapters["root"] / "good" / ".." / "good"),
        "/" + "x" * 5000,
    ]
    for path in paths:
        r = _load(server, "probe", path)
        assert r.status_code == 400, (path, r.text)
        assert r.json()["error"] == {
            "message": NOT_AN_ADAPTER,
            "type": "BadRequestError",
            "param": "lora_path",
            "code": 400,
        }, path


def test_fifo_config_is_refused_at_once(server, adapters):
    start = time.monotonic()
    r = _load(server, "fifo", str(adapters["fifo"]), timeout=15)
    assert r.status_code == 400 and r.json()["error"]["message"] == NOT_AN_ADAPTER
    assert time.monotonic() - start < 10
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200


def test_an_adapter_under_the_root_loads_and_serves(server, adapters):
    assert _load(server, "good", str(adapters["good"])).status_code == 200
    body = {"model": "good", "prompt": "hi", "max_tokens": 3}
    r = httpx.post(server.base_url + "/completions", json=body, timeout=60)
    assert r.status_code == 200 and r.json()["model"] == "good"
    cards = {m["id"] for m in httpx.get(server.base_url + "/models").json()["data"]}
    assert "good" in cards
    assert (
        httpx.post(server.base_url + "/unload_lora_adapter", json={"lora_name": "good"}).status_code
        == 200
    )


def test_without_a_root_any_absolute_path_and_sigterm_never_waits(adapters, tmp_path):
    """vLLM's behaviour without --lora-allowed-root (any absolute path), with the same file
    checks; a FIFO load in flight when SIGTERM comes does not hold the exit."""
    srv = _serve(adapters, tmp_path / "server.log")
    try:
        assert _load(srv, "outside", str(adapters["outside"])).status_code == 200
        refused = _load(srv, "fifo", str(adapters["fifo"]), timeout=15)
        assert refused.status_code == 400, refused.text
        assert _load(srv, "rel", "relative/path").json()["error"]["message"] == NOT_AN_ADAPTER
        loads = [
            threading.Thread(target=_load_ignoring_errors, args=(srv, str(adapters["fifo"])))
            for _ in range(4)
        ]
        for t in loads:
            t.start()
        time.sleep(0.05)
        srv.terminate()
        assert srv.proc.wait(timeout=30) == 0, srv.log()
    except subprocess.TimeoutExpired:
        pytest.fail("SIGTERM did not end the server within 30 s")
    finally:
        srv.stop()


def _load_ignoring_errors(srv: ServerProcess, path: str) -> None:
    try:
        _load(srv, "fifo", path, timeout=15)
    except httpx.HTTPError:
        pass


def test_a_load_stuck_past_its_time_is_refused(monkeypatch):
    """A check that never returns (a hung network mount) is refused after
    ADAPTER_READ_TIMEOUT_S with the same answer."""

    class StuckEngine:
        async def check_lora(self, lora: object) -> None:
            await trio.sleep_forever()

    monkeypatch.setattr(lora, "ADAPTER_READ_TIMEOUT_S", 0.2)
    monkeypatch.setattr(lora, "locate_adapter", lambda path, root: path)
    registry = LoRARegistry("base", allow_updates=True)

    async def main() -> None:
        with pytest.raises(BadRequestError) as exc:
            await lora.load_adapter(registry, StuckEngine(), {"lora_name": "x", "lora_path": "/a"})
        assert str(exc.value) == NOT_AN_ADAPTER and "x" not in registry.adapters

    trio.run(main)


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (
            ["--lora-allowed-root", "/nonexistent/x", "--allow-runtime-lora-updating"],
            "is not a folder",
        ),
        (["--lora-allowed-root", "/tmp"], "--lora-allowed-root: needs --allow-runtime-lora"),
    ],
)
def test_lora_allowed_root_flag_refused_with_the_flag_named(argv, named, capsys, monkeypatch):
    from trillm.entrypoints.cli.lora_flags import check_lora_flags
    from trillm.entrypoints.cli.main import build_parser

    monkeypatch.delenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", raising=False)
    with pytest.raises(SystemExit) as exc:
        args = build_parser().parse_args(["serve", "--enable-lora", *argv])
        check_lora_flags(args.serve_parser, args)
    assert exc.value.code == 2
    assert named in capsys.readouterr().err


def test_adapter_files_that_are_not_regular_are_refused_at_once(adapters, tmp_path):
    """The reader under every path (startup's --lora-modules, the Python API, the worker): a
    FIFO or a device is refused without blocking, a large config by its size."""
    from trillm.lora.files import AdapterFileError, read_regular_file
    from trillm.lora.peft import LoRAAdapterError, read_adapter_config

    outcome: list[BaseException | None] = []

    def read_fifo_adapter() -> None:
        try:
            read_adapter_config(adapters["fifo"], 8)
            outcome.append(None)
        except LoRAAdapterError as exc:
            outcome.append(exc)

    reader = threading.Thread(target=read_fifo_adapter, daemon=True)
    reader.start()
    reader.join(timeout=10)
    assert outcome and "not a regular file" in str(outcome[0]), "the FIFO read blocked"
    with pytest.raises(AdapterFileError, match="not a regular file"):
        read_regular_file(Path("/dev/zero"), 1 << 20)
    big = tmp_path / "adapter_config.json"
    big.write_bytes(b" " * ((1 << 20) + 1))
    with pytest.raises(AdapterFileError, match="the limit is"):
        read_regular_file(big, 1 << 20)
