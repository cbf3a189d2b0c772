"""The P2P connector receives a prompt's KV off the steps (vLLM's asynchronous load): the
request waits in WAITING_FOR_REMOTE_KVS without holding back the requests behind it, is
admitted with the received bytes in its load once they arrived, and computed when they did
not; on both scheduler twins alike, grammars waiting too. The engine core's receiver ends a
silent or refused transfer at its deadline, asks a silent instance again only after a pause,
and bounds the bytes it holds."""

from __future__ import annotations

import socket
import time

from scheduler_twin_helpers import IMPL_NAMES, ecr, get_impl

from trillm.config import CacheConfig, SchedulerConfig
from trillm.core.request import FinishReason, RequestStatus
from trillm.kv_transfer import p2p_wire
from trillm.kv_transfer.config import parse_kv_transfer_config
from trillm.kv_transfer.p2p_recv import Receiver
from trillm.kv_transfer.p2p_scheduler import P2pScheduler
from trillm.kv_transfer.p2p_wire import KVServer, SendStore
from trillm.kv_transfer.scheduler_side import ConnectorSteps, connector_scheduler_cls
from trillm.messages import ModelRunnerOutput, SchedulerOutput

BLOCK = 4
PREFILL = "127.0.0.1:21001"
KEY = "ab" * 20


def _rid(name: str, prefill: str = PREFILL) -> str:
    return f"___prefill_addr_{prefill}___decode_addr_127.0.0.1:1_{name}"


class _FakeReceiver:
    """The receiver as the test says: transfers end when ``arrive`` / ``fail`` is called."""

    def __init__(self) -> None:
        self.asked: list[str] = []
        self.ended: list[str] = []
        self.arrived: dict[str, bytes] = {}

    def want(self, req_id: str, key: str) -> bool:
        assert key.startswith(PREFILL + "/")
        self.asked.append(req_id)
        return True

    def arrive(self, req_id: str, data: bytes | None) -> None:
        if data is not None:
            self.arrived[req_id] = data
        self.ended.append(req_id)

    def finished(self) -> list[str]:
        done, self.ended = self.ended, []
        return done

    def has(self, req_id: str) -> bool:
        return req_id in self.arrived

    def take(self, req_id: str) -> bytes | None:
        return self.arrived.pop(req_id, None)

    def forget(self, req_id: str) -> None:
        self.arrived.pop(req_id, None)


def _twin(name: str) -> tuple[ConnectorSteps, _FakeReceiver]:
    kv = parse_kv_transfer_config(
        {
            "kv_connector": "P2pNcclConnector",
            "kv_role": "kv_consumer",
            "kv_connector_extra_config": {"send_type": "GET", "prefill_kv_addrs": [PREFILL]},
        }
    )
    assert kv is not None
    connector = P2pScheduler(kv, "identity", BLOCK)
    fake = _FakeReceiver()
    connector.receiver = fake  # type: ignore[assignment]
    sched = connector_scheduler_cls(get_impl(name).Scheduler)(
        SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=96, max_model_len=128),
        CacheConfig(block_size=BLOCK),
        32,
        connector,
    )
    return sched, fake


def _run(sched: ConnectorSteps, out: SchedulerOutput) -> None:
    """One step's output: a token for each request whose prompt is computed by it."""
    req_ids = list(out.num_scheduled_tokens)
    sampled = []
    for req_id in req_ids:
        request = sched.get_request(req_id)
        assert request is not None
        sampled.append([7] if request.num_computed_tokens >= request.num_prompt_tokens else [])
    runner = ModelRunnerOutput(step_id=out.step_id, req_ids=req_ids, sampled_token_ids=sampled)
    sched.update_from_output(out, runner)


def _status(sched: ConnectorSteps, req_id: str) -> RequestStatus:
    request = sched.get_request(req_id)
    assert request is not None
    return RequestStatus(request.status)


def _story(name: str) -> list:
    """What one twin does: the scheduled requests, loads and statuses, step by step."""
    sched, fake = _twin(name)
    prompt = list(range(1, 19))  # 18 tokens: 4 whole blocks before the last token
    sched.add_request(ecr(_rid("a"), prompt, 4))
    sched.add_request(ecr(_rid("b"), [t + 100 for t in prompt], 4))
    sched.add_request(ecr("plain", [5, 6, 7], 4))
    sched.add_request(ecr(_rid("g"), [t + 200 for t in prompt], 4))
    sched.set_waiting_for_grammar(_rid("g"))  # as the engine core, after add_request
    sched.add_request(ecr(_rid("short"), [1, 2, 3], 4))  # no whole block: nothing asked
    unlisted = [t + 300 for t in prompt]
    sched.add_request(ecr(_rid("x", "10.9.9.9:1"), unlisted, 4))  # not listed: never asked
    assert fake.asked == [_rid("a"), _rid("b"), _rid("g")]
    story: list = []

    def step() -> None:
        out = sched.schedule()
        assert out.kv_connector_step is not None
        loads = [
            (i.req_id, i.num_tokens, i.first_block, i.data) for i in out.kv_connector_step.loads
        ]
        story.append((sorted(out.num_scheduled_tokens.items()), loads))
        _run(sched, out)

    step()  # the three held wait; the others run
    assert [_status(sched, _rid(n)) for n in "abg"] == [RequestStatus.WAITING_FOR_REMOTE_KVS] * 3
    story.append(sorted(sched.running_req_ids()))
    fake.arrive(_rid("a"), b"KV of a")
    fake.arrive(_rid("b"), None)  # lost: computed
    fake.arrive(_rid("g"), b"KV of g")  # its grammar still compiles: held for it
    step()
    assert _status(sched, _rid("g")) == RequestStatus.WAITING_FOR_GRAMMAR
    sched.grammar_ready(_rid("g"))
    step()
    step()
    story.append(sched.get_stats())
    return story


def test_both_twins_hold_a_request_for_its_remote_kv_and_admit_it_after():
    python, native = (_story(name) for name in IMPL_NAMES)
    assert python == native
    first, running, second, third = python[0], python[1], python[2], python[3]
    assert _rid("a") not in dict(first[0]) and "plain" in dict(first[0])
    assert _rid("short") in running and _rid("x", "10.9.9.9:1") in running
    # a: its 16 tokens loaded from the received bytes, 2 computed; b: all 18 computed
    assert (_rid("a"), 16, 0, b"KV of a") in second[1]
    assert dict(second[0])[_rid("a")] == 2 and dict(second[0])[_rid("b")] == 18
    assert [load[0] for load in third[1]] == [_rid("g")] and third[1][0][3] == b"KV of g"
    stats = python[-1]
    assert stats.external_prefix_cache_hits == 32


def test_an_aborted_waiting_request_forgets_its_transfer():
    sched, fake = _twin(IMPL_NAMES[0])
    sched.add_request(ecr(_rid("a"), list(range(1, 19)), 4))
    sched.finish_requests(_rid("a"), FinishReason.ABORT)
    fake.arrive(_rid("a"), b"late")
    out = sched.schedule()
    assert out.num_scheduled_tokens == {} and not sched.has_unfinished_requests()


def _listening() -> socket.socket:
    server = socket.create_server(("127.0.0.1", 0))
    server.setblocking(False)
    return server


def _wait_finished(receiver: Receiver, timeout: float = 10.0) -> list[str]:
    end = time.monotonic() + timeout
    done: list[str] = []
    while not done and time.monotonic() < end:
        done = receiver.finished()
        time.sleep(0.01)
    return done


def test_the_receiver_ends_a_silent_transfer_and_pauses_that_instance(monkeypatch):
    monkeypatch.setattr(p2p_wire, "FIRST_BYTE_TIMEOUT_S", 0.3)
    with _listening() as silent:
        address = f"127.0.0.1:{silent.getsockname()[1]}"
        receiver = Receiver(10_000)
        assert receiver.want("r1", f"{address}/{KEY}")
        assert _wait_finished(receiver) == ["r1"]
        assert receiver.take("r1") is None and receiver.failures == 1
        assert not receiver.want("r2", f"{address}/{KEY}")  # paused: computed at once
        assert receiver.failures == 2 and receiver.finished() == []


def test_the_receiver_takes_what_came_within_its_bound():
    store = SendStore(100_000)
    store.put(KEY, b"z" * 5000)
    store.put("cd" * 20, b"z" * 20_000)
    server = KVServer(store, "127.0.0.1", 0)
    try:
        address = f"127.0.0.1:{server.address[1]}"
        receiver = Receiver(10_000)
        assert receiver.want("r1", f"{address}/{KEY}")
        assert _wait_finished(receiver) == ["r1"] and receiver.has("r1")
        assert receiver.want("r2", f"{address}/{'cd' * 20}")  # over the bound: not kept
        assert _wait_finished(receiver) == ["r2"] and not receiver.has("r2")
        assert receiver.take("r1") == [b"z" * 5000] and receiver.failures == 1
        receiver.forget("r3")  # unknown: nothing happens
    finally:
        server.close()


def test_a_refused_transfer_ends_at_once():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, not listening: refused
        receiver = Receiver(10_000)
        assert receiver.want("r1", f"127.0.0.1:{port}/{KEY}")
        assert _wait_finished(receiver, 2.0) == ["r1"] and receiver.failures == 1
