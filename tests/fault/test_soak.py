"""A bounded soak on loopback against a real ``trillm serve`` (issue 11): mixed traffic for
``TRILLM_SOAK_SECONDS`` (default 20 s, about 500 calls; longer when exploring) after a
warm-up, then checks that nothing accumulates.

Traffic (six client threads, seeded): completions and chat, streamed and not, ``n`` up to 3,
``/tokenize`` and ``/detokenize``, clients that leave mid-stream, and bad requests (each must
be a 4xx in OpenAI's error shape). Every answer is checked as it comes.

Afterwards: the resident memory of the server and its worker processes (VmRSS from /proc)
grew less than a tolerance between the end of the warm-up and the end; the server's open fds
and the shared-memory segments its processes map are back to what they were after the
warm-up; /metrics says no request running or waiting and KV usage 0; and SIGTERM exits 0
leaving no segment in /dev/shm.

The real embedded default model (no MODEL argument) runs, so the model runner's own memory is
part of what is measured.
"""

from __future__ import annotations

import json
import os
import random
import threading
import time
from pathlib import Path

import httpx
import pytest
from server_harness import ServerProcess, metric_value

pytestmark = pytest.mark.slow

SOAK_SECONDS = float(os.environ.get("TRILLM_SOAK_SECONDS", "20"))
WARMUP_SECONDS = 8.0
CLIENTS = 6
# Growth allowed from the end of the warm-up to the end of the soak, for all processes
# together: allocator arenas and caches settle in steps, a leak grows with every request.
RSS_TOLERANCE_BYTES = 48 * 2**20
FD_SLACK = 2
KEEP_ALIVE_S = 1


# ---------------------------------------------------------------- /proc


def process_tree(pid: int) -> list[int]:
    """``pid`` and all its descendants (from /proc/<pid>/task/*/children)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        try:
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as f:
                    todo.extend(int(c) for c in f.read().split())
        except FileNotFoundError:
            continue
    return out


def rss_bytes(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except FileNotFoundError:
        pass
    return 0


def tree_rss(pid: int) -> int:
    return sum(rss_bytes(p) for p in process_tree(pid))


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def shm_segments(pid: int) -> set[str]:
    """The /dev/shm files the server's processes map or hold open."""
    names: set[str] = set()
    for p in process_tree(pid):
        try:
            with open(f"/proc/{p}/maps") as f:
                for line in f:
                    if "/dev/shm/" in line:
                        names.add(line.split("/dev/shm/", 1)[1].split()[0])
            for fd in os.listdir(f"/proc/{p}/fd"):
                try:
                    target = os.readlink(f"/proc/{p}/fd/{fd}")
                except OSError:
                    continue
                if target.startswith("/dev/shm/"):
                    names.add(target[len("/dev/shm/") :].split()[0])
        except FileNotFoundError:
            continue
    return names


# ---------------------------------------------------------------- traffic


BAD_REQUESTS = [
    ("/v1/completions", {"prompt": "x", "temperature": -1}),
    ("/v1/completions", {"prompt": "x", "max_tokens": 10**9}),
    ("/v1/completions", {"prompt": "x", "seed": 2**64}),
    ("/v1/completions", {"prompt": "x", "model": "no-such-model"}),
    ("/v1/completions", {"prompt": []}),
    ("/v1/chat/completions", {"messages": "not a list"}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "n": 0}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": -1}),
    ("/detokenize", {"tokens": [-1]}),
]
PROMPTS = ["The capital of France is", "Once upon a time", "1, 2, 3,", "In the beginning"]


class Traffic:
    def __init__(self, srv: ServerProcess) -> None:
        self.srv = srv
        self.errors: list[str] = []
        self.counts: dict[str, int] = {}
        self.stop = threading.Event()

    def count(self, kind: str) -> None:
        self.counts[kind] = self.counts.get(kind, 0) + 1

    def fail(self, kind: str, what: str) -> None:
        self.errors.append(f"{kind}: {what}"[:500])

    def client_loop(self, seed: int) -> None:
        rng = random.Random(seed)
        kinds = [
            self.completion,
            self.completion_stream,
            self.chat,
            self.chat_stream,
            self.disconnect,
            self.bad,
            self.tokenize,
        ]
        with httpx.Client(base_url=self.srv.url, timeout=60) as client:
            while not self.stop.is_set():
                kind = rng.choice(kinds)
                try:
                    kind(client, rng)
                except Exception as e:  # noqa: BLE001 - every failure is reported at the end
                    self.fail(kind.__name__, repr(e))
                self.count(kind.__name__)

    def completion(self, client: httpx.Client, rng: random.Random) -> None:
        n = rng.randint(1, 3)
        body = {"prompt": rng.choice(PROMPTS), "max_tokens": rng.randint(1, 24), "n": n}
        r = client.post("/v1/completions", json=body)
        if r.status_code != 200 or len(r.json()["choices"]) != n:
            self.fail("completion", f"{r.status_code} {r.text}")

    def chat(self, client: httpx.Client, rng: random.Random) -> None:
        body = {
            "messages": [{"role": "user", "content": rng.choice(PROMPTS)}],
            "max_tokens": rng.randint(1, 24),
            "n": rng.randint(1, 2),
            "temperature": rng.choice([0, 0.7, 1.0]),
        }
        r = client.post("/v1/chat/completions", json=body)
        if r.status_code != 200 or r.json()["choices"][0]["finish_reason"] is None:
            self.fail("chat", f"{r.status_code} {r.text}")

    def _stream(self, client: httpx.Client, path: str, body: dict, leave_after: int | None) -> None:
        events = 0
        with client.stream("POST", path, json={**body, "stream": True}) as r:
            if r.status_code != 200:
                self.fail(path, f"{r.status_code} {r.read()!r}")
                return
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    return
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    self.fail(path, line)
                    return
                events += 1
                if leave_after is not None and events >= leave_after:
                    return  # closing the response drops the connection mid-stream
        if leave_after is None:
            self.fail(path, "stream ended without [DONE]")

    def completion_stream(self, client: httpx.Client, rng: random.Random) -> None:
        body = {"prompt": rng.choice(PROMPTS), "max_tokens": rng.randint(1, 24), "n": 2}
        self._stream(client, "/v1/completions", body, None)

    def chat_stream(self, client: httpx.Client, rng: random.Random) -> None:
        body = {
            "messages": [{"role": "user", "content": rng.choice(PROMPTS)}],
            "max_tokens": rng.randint(1, 24),
            "stream_options": {"include_usage": True},
        }
        self._stream(client, "/v1/chat/completions", body, None)

    def disconnect(self, client: httpx.Client, rng: random.Random) -> None:
        path, body = rng.choice(
            [
                ("/v1/completions", {"prompt": rng.choice(PROMPTS), "n": rng.randint(1, 3)}),
                ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
            ]
        )
        body = {**body, "max_tokens": 200, "ignore_eos": True}
        self._stream(client, path, body, leave_after=rng.randint(1, 4))

    def bad(self, client: httpx.Client, rng: random.Random) -> None:
        if rng.random() < 0.2:
            r = client.post(
                "/v1/completions",
                content=b'{"prompt": "x", "max_tokens": ',
                headers={"content-type": "application/json"},
            )
        else:
            path, body = rng.choice(BAD_REQUESTS)
            r = client.post(path, json=body)
        if not 400 <= r.status_code < 500 or "message" not in r.json().get("error", {}):
            self.fail("bad", f"{r.status_code} {r.text}")

    def tokenize(self, client: httpx.Client, rng: random.Random) -> None:
        text = rng.choice(PROMPTS)
        r = client.post("/tokenize", json={"prompt": text, "add_special_tokens": False})
        if r.status_code != 200:
            self.fail("tokenize", r.text)
            return
        r = client.post("/detokenize", json={"tokens": r.json()["tokens"]})
        if r.status_code != 200 or r.json()["prompt"] != text:
            self.fail("detokenize", r.text)

    def run_for(self, seconds: float, seed: int) -> None:
        self.stop.clear()
        threads = [
            threading.Thread(target=self.client_loop, args=(seed * 100 + i,), daemon=True)
            for i in range(CLIENTS)
        ]
        for t in threads:
            t.start()
        time.sleep(seconds)
        self.stop.set()
        for t in threads:
            t.join(timeout=120)
            assert not t.is_alive(), "a client thread hung"


# ---------------------------------------------------------------- the test


def scheduler_gauges(srv: ServerProcess) -> tuple[float, float, float]:
    text = httpx.get(srv.url + "/metrics", timeout=10).text
    return (
        metric_value(text, "trillm:num_requests_running"),
        metric_value(text, "trillm:num_requests_waiting"),
        metric_value(text, "trillm:kv_cache_usage_perc"),
    )


def wait_idle(srv: ServerProcess, within: float = 30.0) -> None:
    deadline = time.monotonic() + within
    while (g := scheduler_gauges(srv)) != (0.0, 0.0, 0.0):
        assert time.monotonic() < deadline, f"running/waiting/KV usage stuck at {g}"
        time.sleep(0.2)


def settled_fds(pid: int, within: float = 20.0) -> int:
    """Open fds once the sockets of closed connections are gone: hypercorn (trio) keeps a
    connection's socket until its keep-alive timer ends even after the client closed it, so
    wait until the count has not changed for longer than that timer."""
    deadline = time.monotonic() + within
    n, since = open_fds(pid), time.monotonic()
    while time.monotonic() < deadline and time.monotonic() - since < KEEP_ALIVE_S + 1:
        time.sleep(0.25)
        if (now := open_fds(pid)) != n:
            n, since = now, time.monotonic()
    return n


def test_soak(tmp_path: Path):
    srv = ServerProcess(
        [
            "--kv-cache-memory",
            "64MiB",
            "--max-num-seqs",
            "16",
            "--max-model-len",
            "512",
            "--timeout-keep-alive",
            str(KEEP_ALIVE_S),
        ],
        tmp_path / "server.log",
    ).start()
    shm_after_warmup: set[str] = set()
    try:
        pid = srv.proc.pid
        traffic = Traffic(srv)
        traffic.run_for(WARMUP_SECONDS, seed=1)
        wait_idle(srv)
        rss_after_warmup = tree_rss(pid)
        fds_after_warmup = settled_fds(pid)
        shm_after_warmup = shm_segments(pid)
        assert shm_after_warmup, "the engine's shared-memory rings were not found"

        samples: list[int] = []
        sampler_stop = threading.Event()

        def sample() -> None:
            while not sampler_stop.wait(2.0):
                samples.append(tree_rss(pid))

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        traffic.run_for(SOAK_SECONDS, seed=2)
        sampler_stop.set()
        sampler.join()

        assert not traffic.errors, f"{len(traffic.errors)} errors, first: {traffic.errors[:5]}"
        served = sum(traffic.counts.values())
        assert served > 50, traffic.counts
        assert traffic.counts.get("disconnect"), traffic.counts

        wait_idle(srv)
        rss_end = tree_rss(pid)
        growth = rss_end - rss_after_warmup
        mib = [round(s / 2**20) for s in samples]
        assert growth < RSS_TOLERANCE_BYTES, (
            f"RSS grew {growth / 2**20:.0f} MiB over {served} requests "
            f"(after warm-up {rss_after_warmup / 2**20:.0f} MiB, samples {mib} MiB)"
        )
        fds_end = settled_fds(pid)
        assert fds_end <= fds_after_warmup + FD_SLACK, (fds_after_warmup, fds_end)
        assert shm_segments(pid) == shm_after_warmup
        assert srv.proc.poll() is None
        print(
            f"soak: {served} calls {traffic.counts}; RSS {rss_after_warmup / 2**20:.0f} -> "
            f"{rss_end / 2**20:.0f} MiB; fds {fds_after_warmup} -> {fds_end}"
        )
    finally:
        code = srv.stop()
    assert code == 0, srv.log()
    leftover = {n for n in shm_after_warmup if os.path.exists(f"/dev/shm/{n}")}
    assert not leftover, f"shared memory left behind: {leftover}"
