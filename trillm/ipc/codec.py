"""Messages <-> bytes: msgpack, never pickle.

A frame is one msgpack array ``[tag, field, field, ...]``. The per-step messages
(``SchedulerOutput``, ``SampleRequest``, ``ModelRunnerOutput``) are encoded by hand as positional
lists, because they cross the ring every step and most of their bulk (token ids, block ids) is
already plain lists that msgpack packs in C. The rare control messages go through a cattrs
``Converter`` (``TrillmConfig`` is a tree of dataclasses). Both ends run the same code, so
positional encoding needs no versioning.

``decode`` checks the tag and the arity of every record and raises ``CodecError`` on anything
malformed; it does not re-validate every leaf's type (the ring's checksum guards transport
corruption, this guards bugs).
"""

from __future__ import annotations

from dataclasses import fields
from typing import Any

import cattrs
import msgpack

from trillm.config import TrillmConfig
from trillm.errors import CodecError
from trillm.ipc.control import (
    InitKVCache,
    InitWorker,
    Shutdown,
    WorkerCall,
    WorkerCallResult,
    WorkerFailed,
    WorkerReady,
)
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

Message = (
    SchedulerOutput
    | SampleRequest
    | ModelRunnerOutput
    | InitWorker
    | InitKVCache
    | Shutdown
    | WorkerReady
    | WorkerFailed
    | WorkerCall
    | WorkerCallResult
)

_converter = cattrs.Converter()

_SP_FIELDS = tuple(f.name for f in fields(SamplingParams))
_SO_FIELDS = tuple(f.name for f in fields(StructuredOutputsParams))
_SP_OUTPUT_KIND = _SP_FIELDS.index("output_kind")
_SP_STRUCTURED = _SP_FIELDS.index("structured_outputs")

_T_SCHED, _T_SAMPLE, _T_OUTPUT, _T_INIT, _T_INIT_KV, _T_SHUTDOWN, _T_READY, _T_FAILED = range(8)
_T_CALL, _T_CALL_RESULT = 8, 9


# ---------------------------------------------------------------- sampling params


def _enc_sampling(sp: SamplingParams) -> list[Any]:
    values = [getattr(sp, name) for name in _SP_FIELDS]
    values[_SP_OUTPUT_KIND] = int(sp.output_kind)
    so = sp.structured_outputs
    if so is not None:
        values[_SP_STRUCTURED] = [getattr(so, name) for name in _SO_FIELDS]
    return values


def _dec_sampling(values: list[Any]) -> SamplingParams:
    _check_arity(values, len(_SP_FIELDS), "SamplingParams")
    kwargs = dict(zip(_SP_FIELDS, values))
    kwargs["output_kind"] = RequestOutputKind(kwargs["output_kind"])
    so = kwargs["structured_outputs"]
    if so is not None:
        _check_arity(so, len(_SO_FIELDS), "StructuredOutputsParams")
        kwargs["structured_outputs"] = StructuredOutputsParams(*so)
    # NOTE: not validated again: the engine did that, and a value that still breaks the
    # worker must fail its own request there, not the whole frame (and with it the worker).
    return SamplingParams.from_validated(kwargs)


# ---------------------------------------------------------------- scheduler output


def _enc_new_req(r: NewRequestData) -> list[Any]:
    return [
        r.req_id,
        r.prompt_token_ids,
        r.output_token_ids,
        _enc_sampling(r.sampling_params),
        r.block_ids,
        r.num_computed_tokens,
        None
        if (lo := r.lora_request) is None
        else [lo.lora_name, lo.lora_int_id, lo.lora_path, lo.base_model_name],
        [
            [m.modality, m.content_hash, m.offset, m.length, m.data, m.shape, m.time_interval]
            for m in r.mm_items
        ],
    ]


def _dec_new_req(v: list[Any]) -> NewRequestData:
    _check_arity(v, 8, "NewRequestData")
    lora = None
    if v[6] is not None:
        _check_arity(v[6], 4, "LoRARequest")
        lora = LoRARequest(*v[6])
    items = []
    for m in v[7]:
        _check_arity(m, 7, "MultiModalItem")
        items.append(MultiModalItem(*m))
    return NewRequestData(v[0], v[1], v[2], _dec_sampling(v[3]), v[4], v[5], lora, items)


def _enc_sched(s: SchedulerOutput) -> list[Any]:
    c = s.scheduled_cached_reqs
    return [
        _T_SCHED,
        s.step_id,
        [_enc_new_req(r) for r in s.scheduled_new_reqs],
        [c.req_ids, c.new_block_ids, c.num_computed_tokens],
        s.num_scheduled_tokens,
        s.total_num_scheduled_tokens,
        s.scheduled_spec_decode_tokens,
        s.finished_req_ids,
        s.wait_for_bitmask,
        s.pp_sampled_token_ids,
        s.free_encoder_mm_hashes,
        None if (k := s.kv_connector_step) is None else [_enc_kv(k.loads), _enc_kv(k.saves)],
    ]


def _enc_kv(items: list[KVTransferItem]) -> list[Any]:
    return [
        [i.req_id, i.key, i.block_ids, i.num_tokens, i.first_block, i.offload_blocks, i.data]
        for i in items
    ]


def _dec_kv(v: list[Any] | None) -> KVConnectorStep | None:
    if v is None:
        return None
    _check_arity(v, 2, "KVConnectorStep")
    loads, saves = ([KVTransferItem(*i) for i in items] for items in v)
    return KVConnectorStep(loads, saves)


def _dec_sched(v: list[Any]) -> SchedulerOutput:
    _check_arity(v, 12, "SchedulerOutput")
    _check_arity(v[3], 3, "CachedRequestData")
    return SchedulerOutput(
        step_id=v[1],
        scheduled_new_reqs=[_dec_new_req(r) for r in v[2]],
        scheduled_cached_reqs=CachedRequestData(*v[3]),
        num_scheduled_tokens=v[4],
        total_num_scheduled_tokens=v[5],
        scheduled_spec_decode_tokens=v[6],
        finished_req_ids=v[7],
        wait_for_bitmask=v[8],
        pp_sampled_token_ids=v[9],
        free_encoder_mm_hashes=v[10],
        kv_connector_step=_dec_kv(v[11]),
    )


# ---------------------------------------------------------------- model runner output


def _enc_logprobs(d: dict[str, LogprobsLists]) -> dict[str, list[Any]]:
    return {rid: [lp.token_ids, lp.logprobs, lp.ranks] for rid, lp in d.items()}


def _dec_logprobs(d: dict[str, list[Any]]) -> dict[str, LogprobsLists]:
    out = {}
    for rid, v in d.items():
        _check_arity(v, 3, "LogprobsLists")
        out[rid] = LogprobsLists(v[0], v[1], v[2])
    return out


def _enc_output(o: ModelRunnerOutput) -> list[Any]:
    return [
        _T_OUTPUT,
        o.step_id,
        o.req_ids,
        o.sampled_token_ids,
        _enc_logprobs(o.logprobs),
        _enc_logprobs(o.prompt_logprobs),
        o.model_time_s,
        o.error,
        o.failed,
        o.pooler_output,
        o.draft_token_ids,
        o.kv_load_failed,
        o.expert_load,
        o.model_forward_time,
        o.model_execute_time,
        o.kv_offload_seconds,
    ]


def _dec_output(v: list[Any]) -> ModelRunnerOutput:
    _check_arity(v, 16, "ModelRunnerOutput")
    return ModelRunnerOutput(
        v[1],
        v[2],
        v[3],
        _dec_logprobs(v[4]),
        _dec_logprobs(v[5]),
        float(v[6]),
        v[7],
        v[8],
        v[9],
        v[10],
        v[11],
        v[12],
        v[13],
        v[14],
        v[15],
    )


# ---------------------------------------------------------------- control messages


def _enc_control(tag: int, msg: Any) -> list[Any]:
    if isinstance(msg, InitWorker):
        return [tag, _converter.unstructure(msg.config), msg.runner, msg.runner_kwargs]
    return [tag, *(getattr(msg, f.name) for f in fields(msg))]


def _dec_init(v: list[Any]) -> InitWorker:
    _check_arity(v, 4, "InitWorker")
    return InitWorker(_converter.structure(v[1], TrillmConfig), v[2], v[3])


def _dec_plain(cls: type, v: list[Any]) -> Any:
    _check_arity(v, 1 + len(fields(cls)), cls.__name__)
    return cls(*v[1:])


_CONTROL_TAGS: dict[type, int] = {
    SampleRequest: _T_SAMPLE,
    InitWorker: _T_INIT,
    InitKVCache: _T_INIT_KV,
    Shutdown: _T_SHUTDOWN,
    WorkerReady: _T_READY,
    WorkerFailed: _T_FAILED,
    WorkerCall: _T_CALL,
    WorkerCallResult: _T_CALL_RESULT,
}

_DECODERS = {
    _T_SCHED: _dec_sched,
    _T_SAMPLE: lambda v: _dec_plain(SampleRequest, v),
    _T_OUTPUT: _dec_output,
    _T_INIT: _dec_init,
    _T_INIT_KV: lambda v: _dec_plain(InitKVCache, v),
    _T_SHUTDOWN: lambda v: _dec_plain(Shutdown, v),
    _T_READY: lambda v: _dec_plain(WorkerReady, v),
    _T_FAILED: lambda v: _dec_plain(WorkerFailed, v),
    _T_CALL: lambda v: _dec_plain(WorkerCall, v),
    _T_CALL_RESULT: lambda v: _dec_plain(WorkerCallResult, v),
}


def _check_arity(v: Any, n: int, name: str) -> None:
    if not isinstance(v, list) or len(v) != n:
        got = f"{len(v)} fields" if isinstance(v, list) else type(v).__name__
        raise CodecError(f"Malformed {name}: expected a list of {n} fields, got {got}.")


# ---------------------------------------------------------------- public API


def new_request_encodes(r: NewRequestData) -> bool:
    """Whether one request's data can cross the boundary (finds the one that broke a step)."""
    try:
        msgpack.packb(_enc_new_req(r), use_bin_type=True)
    except Exception:
        return False
    return True


def encode(msg: Message) -> bytes:
    """One message -> one msgpack frame."""
    if isinstance(msg, SchedulerOutput):
        obj = _enc_sched(msg)
    elif isinstance(msg, ModelRunnerOutput):
        obj = _enc_output(msg)
    elif type(msg) in _CONTROL_TAGS:
        obj = _enc_control(_CONTROL_TAGS[type(msg)], msg)
    else:
        raise TypeError(f"Cannot encode {type(msg).__name__}: not a trillm IPC message.")
    try:
        return msgpack.packb(obj, use_bin_type=True)
    except (TypeError, ValueError, OverflowError) as exc:
        raise CodecError(f"Cannot encode {type(msg).__name__}: {exc}") from exc


def decode(frame: bytes | memoryview) -> Message:
    """One msgpack frame -> one message; ``CodecError`` if the frame is malformed."""
    try:
        obj = msgpack.unpackb(frame, raw=False, strict_map_key=False, use_list=True)
    except Exception as exc:  # msgpack raises several unrelated types (ExtraData, ValueError...)
        raise CodecError(f"Malformed frame ({len(frame)} bytes): {exc}") from exc
    if not isinstance(obj, list) or not obj or not isinstance(obj[0], int):
        raise CodecError(f"Malformed frame: expected [tag, ...], got {type(obj).__name__}.")
    decoder = _DECODERS.get(obj[0])
    if decoder is None:
        raise CodecError(f"Malformed frame: unknown message tag {obj[0]}.")
    try:
        return decoder(obj)
    except CodecError:
        raise
    except (TypeError, ValueError, KeyError, IndexError, cattrs.BaseValidationError) as exc:
        raise CodecError(f"Malformed frame for tag {obj[0]}: {exc}") from exc
