"""The msgpack codec: round trips of every message type, and malformed frames."""

from __future__ import annotations

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trillm.errors import CodecError
from trillm.ipc import codec
from trillm.ipc.control import InitKVCache, InitWorker, Shutdown, WorkerFailed, WorkerReady
from trillm.lora.request import LoRARequest
from trillm.messages import (
    CachedRequestData,
    KVConnectorStep,
    KVTransferItem,
    LogprobsLists,
    ModelRunnerOutput,
    MultiModalItem,
    NewRequestData,
    SampleRequest,
    SchedulerOutput,
)
from trillm.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams
from trillm.worker.fake_runner import make_fake_config

ids = st.lists(st.integers(0, 2**31 - 1), max_size=20)
req_id = st.text(min_size=1, max_size=12)
finite = st.floats(allow_nan=False, allow_infinity=False, width=64)


@st.composite
def sampling_params(draw) -> SamplingParams:
    max_tokens = draw(st.none() | st.integers(1, 4096))
    structured = draw(
        st.none()
        | st.builds(StructuredOutputsParams, regex=st.text(max_size=10))
        | st.builds(
            StructuredOutputsParams, choice=st.lists(st.text(max_size=5), min_size=1, max_size=3)
        )
        | st.builds(StructuredOutputsParams, json=st.dictionaries(st.text(max_size=4), ids))
    )
    return SamplingParams(
        n=draw(st.integers(1, 4)),
        presence_penalty=draw(st.floats(-2, 2)),
        repetition_penalty=draw(st.floats(0.01, 3)),
        temperature=draw(st.floats(0, 2)),
        top_p=draw(st.floats(0.01, 1)),
        top_k=draw(st.integers(0, 100)),
        min_p=draw(st.floats(0, 1)),
        seed=draw(st.none() | st.integers(0, 2**63 - 1)),
        stop=draw(st.none() | st.lists(st.text(min_size=1, max_size=5), max_size=3)),
        stop_token_ids=draw(st.none() | ids),
        max_tokens=max_tokens,
        min_tokens=draw(st.integers(0, max_tokens or 10)),
        logprobs=draw(st.none() | st.integers(0, 20)),
        logit_bias=draw(st.none() | st.dictionaries(st.integers(0, 5000), st.floats(-100, 100))),
        output_kind=draw(st.sampled_from(RequestOutputKind)),
        structured_outputs=structured,
        extra_args=draw(
            st.none() | st.dictionaries(st.text(max_size=4), st.integers(-(2**63), 2**63 - 1))
        ),
        bad_words_token_ids=draw(st.none() | st.lists(ids, max_size=3)),
        all_stop_token_ids=draw(ids),
    )


kv_items = st.lists(
    st.builds(
        KVTransferItem,
        req_id,
        st.text(max_size=40),
        ids,
        st.integers(0, 10**6),
        st.integers(0, 64),
        ids,  # offload_blocks (the KV offload tier's)
    ),
    max_size=3,
)
kv_steps = st.builds(KVConnectorStep, kv_items, kv_items)


@st.composite
def scheduler_outputs(draw) -> SchedulerOutput:
    new = draw(
        st.lists(
            st.builds(
                NewRequestData,
                req_id,
                ids,
                ids,
                sampling_params(),
                ids,
                st.integers(0, 10**6),
                st.none()
                | st.builds(
                    LoRARequest, req_id, st.integers(1, 2**31), st.just("/a"), st.none() | req_id
                ),
            ),
            max_size=3,
        )
    )
    cached_ids = draw(st.lists(req_id, max_size=5))
    cached = CachedRequestData(
        cached_ids,
        [draw(ids) for _ in cached_ids],
        [draw(st.integers(0, 10**6)) for _ in cached_ids],
    )
    return SchedulerOutput(
        step_id=draw(st.integers(0, 2**62)),
        scheduled_new_reqs=new,
        scheduled_cached_reqs=cached,
        num_scheduled_tokens=draw(st.dictionaries(req_id, st.integers(1, 8192))),
        total_num_scheduled_tokens=draw(st.integers(0, 10**6)),
        scheduled_spec_decode_tokens=draw(st.dictionaries(req_id, ids, max_size=2)),
        finished_req_ids=draw(st.lists(req_id, max_size=3)),
        wait_for_bitmask=draw(st.booleans()),
        pp_sampled_token_ids=draw(st.dictionaries(req_id, ids, max_size=3)),
        free_encoder_mm_hashes=draw(st.lists(st.text(max_size=16), max_size=3)),
        kv_connector_step=draw(st.none() | kv_steps),
    )


logprobs_lists = st.builds(
    LogprobsLists,
    st.lists(ids, max_size=3),
    st.lists(st.lists(finite, max_size=4), max_size=3),
    ids,
)

model_runner_outputs = st.builds(
    ModelRunnerOutput,
    step_id=st.integers(0, 2**62),
    req_ids=st.lists(req_id, max_size=5),
    sampled_token_ids=st.lists(ids, max_size=5),
    logprobs=st.dictionaries(req_id, logprobs_lists, max_size=3),
    prompt_logprobs=st.dictionaries(req_id, logprobs_lists, max_size=2),
    model_time_s=finite,
    error=st.none() | st.text(max_size=50),
    draft_token_ids=st.dictionaries(req_id, ids, max_size=3),
    kv_load_failed=st.dictionaries(req_id, st.text(max_size=20), max_size=2),
    expert_load=st.lists(st.integers(0, 2**62), max_size=4),
    model_forward_time=st.none() | finite,
    model_execute_time=st.none() | finite,
    kv_offload_seconds=st.lists(finite, max_size=2),
)

sample_requests = st.builds(
    SampleRequest, st.integers(0, 2**62), st.dictionaries(req_id, ids, max_size=3)
)

control_messages = st.one_of(
    st.builds(InitKVCache, st.integers(0, 10**7)),
    st.just(Shutdown()),
    st.builds(
        WorkerReady,
        st.integers(0, 7),
        st.sampled_from(["loaded", "kv_cache"]),
        st.integers(0, 10**7),
    ),
    st.builds(WorkerFailed, st.integers(0, 7), st.text(max_size=100)),
)


@settings(max_examples=40, deadline=None)
@given(scheduler_outputs())
def test_scheduler_output_round_trip(msg):
    assert codec.decode(codec.encode(msg)) == msg


@settings(max_examples=40, deadline=None)
@given(model_runner_outputs)
def test_model_runner_output_round_trip(msg):
    assert codec.decode(codec.encode(msg)) == msg


@settings(max_examples=30, deadline=None)
@given(sample_requests)
def test_sample_request_round_trip(msg):
    assert codec.decode(codec.encode(msg)) == msg


@settings(max_examples=30, deadline=None)
@given(control_messages)
def test_control_message_round_trip(msg):
    assert codec.decode(codec.encode(msg)) == msg


def test_init_worker_round_trip_carries_the_whole_config():
    config = make_fake_config(num_blocks=77, tensor_parallel_size=2)
    config.model.rope_scaling = {"rope_type": "llama3", "factor": 8.0}
    config.model.hf_config = {"nested": {"list": [1, 2.5, None, "x"]}}
    msg = InitWorker(config, "trillm.worker.fake_runner:FakeModelRunner", {"step_sleep_s": 0.5})
    back = codec.decode(codec.encode(msg))
    assert back == msg
    assert back.config.cache.num_gpu_blocks_override == 77


def test_enum_and_int_keys_survive():
    sp = SamplingParams(output_kind=RequestOutputKind.DELTA, logit_bias={7: 1.5})
    new = NewRequestData("r", [1], [], sp, [0], 0)
    sched = SchedulerOutput(1, [new], CachedRequestData(), {"r": 1}, 1)
    back = codec.decode(codec.encode(sched)).scheduled_new_reqs[0].sampling_params
    assert back.output_kind is RequestOutputKind.DELTA
    assert back.logit_bias == {7: 1.5}


def test_multimodal_items_round_trip():
    item = MultiModalItem("image", "ab12", 6, 16, b"\x00\x01" * 6, [3, 1, 2])
    new = NewRequestData("r", [1], [], SamplingParams(), [0], 0, None, [item])
    sched = SchedulerOutput(1, [new], CachedRequestData(), {"r": 1}, 1)
    assert codec.decode(codec.encode(sched)).scheduled_new_reqs[0].mm_items == [item]


def test_unencodable_contents_raise_codec_error():
    sp = SamplingParams()
    sp.extra_args = {"big": 2**70}  # SamplingParams refuses it; the codec must still not crash
    sched = SchedulerOutput(
        1, [NewRequestData("r", [1], [], sp, [0], 0)], CachedRequestData(), {}, 1
    )
    with pytest.raises(CodecError, match="Cannot encode SchedulerOutput"):
        codec.encode(sched)


def test_encode_rejects_foreign_objects():
    with pytest.raises(TypeError, match="Cannot encode dict: not a trillm IPC message"):
        codec.encode({"step_id": 1})


@pytest.mark.parametrize(
    ("frame", "match"),
    [
        (b"", "Malformed frame"),
        (b"\xc1", "Malformed frame"),  # a byte msgpack never uses
        (msgpack.packb({"a": 1}), r"expected \[tag, ...\], got dict"),
        (msgpack.packb([]), r"expected \[tag, ...\]"),
        (msgpack.packb([99, 1]), "unknown message tag 99"),
        (
            msgpack.packb([0, 1, 2]),
            "Malformed SchedulerOutput: expected a list of 12 fields, got 3",
        ),
        (msgpack.packb([2, 1, [], [], {}, {}, 0.0]), "Malformed ModelRunnerOutput"),
        (
            msgpack.packb(
                [
                    0,
                    1,
                    [["r", [], [], [1, 2], [], 0, None, []]],
                    [[], [], []],
                    {},
                    0,
                    {},
                    [],
                    False,
                    {},
                    [],
                    None,
                ]
            ),
            "Malformed SamplingParams",
        ),
        (
            msgpack.packb(
                [2, 1, [], [], {"r": [1, 2]}, {}, 0.0, None, {}, {}, {}, {}, [], None, None, []]
            ),
            "Malformed LogprobsLists",
        ),
        (msgpack.packb([3, {"model": 1}, "x", {}]), "Malformed frame for tag 3"),
    ],
)
def test_malformed_frames_raise_codec_error(frame, match):
    with pytest.raises(CodecError, match=match):
        codec.decode(frame)


def test_truncated_frame_raises_codec_error():
    frame = codec.encode(SampleRequest(3, {"r": [1, 2, 3]}))
    with pytest.raises(CodecError):
        codec.decode(frame[:-2])
