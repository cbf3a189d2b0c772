"""Engine outputs built by hand for the output-processor tests: a text with multi-byte
characters, its ids, one step's ``EngineCoreOutput``, a collector drained."""

from __future__ import annotations

from trillm.engine.output_collector import RequestOutputCollector
from trillm.messages import EngineCoreOutput, FinishReason
from trillm.outputs import RequestOutput

TEXT = "The quick brown fox jumps over the lazy dog. 你好🙂 done"


def ids_of(tok, text: str = TEXT) -> list[int]:
    return tok.encode(text)


def step(req: str, ids: list[int], finish: FinishReason | None = None, **kw) -> EngineCoreOutput:
    return EngineCoreOutput(request_id=req, new_token_ids=ids, finish_reason=finish, **kw)


def drain(collector: RequestOutputCollector) -> list[RequestOutput]:
    out = []
    while (o := collector.get_nowait()) is not None:
        out.append(o)
    return out
