"""The last pipeline stage's sampled tokens, on the other stages (pipeline parallelism).

Only the last stage computes logits and samples; every other rank's batch must still append the
same tokens (stage 0 embeds them when the request runs next; every stage counts them to place
its positions). No collective carries them: the engine core returns the last stage's tokens as
the step's output, then sends them to every rank with the next step it schedules
(``SchedulerOutput.pp_sampled_token_ids``: req_id -> the tokens appended since the last step
sent, the verified drafts included). So no stage ever waits for a later one except for its
hidden states to be taken, and several steps can be in flight (the engine core's batch queue):
stage 0 runs step i + 1 while the last stage runs step i. A request is in one in-flight step at
most, so its tokens arrive before the step that needs them.
"""

from __future__ import annotations

from trillm.sample.state import SamplingState
from trillm.worker.input_batch import InputBatch


def append_sampled(tokens: dict[str, list[int]], batch: InputBatch, state: SamplingState) -> None:
    """Appends each request's tokens to this rank's batch and sampling state, as the last stage
    appended them. Requests no longer in the batch (finished, aborted) are skipped."""
    slots: list[int] = []
    flat: list[int] = []
    for req_id, new in tokens.items():
        slot = batch.req_slot.get(req_id)
        if slot is None or not new:
            continue
        batch.append_tokens(slot, new)
        slots += [slot] * len(new)
        flat += new
    if slots:
        state.append_tokens(slots, flat)
