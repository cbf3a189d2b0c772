"""Verifying draft tokens in the worker: one forward scores every drafted position.

A request with ``d`` drafts is scheduled ``1 + d`` tokens: its last token and the drafts. The
forward's last ``d + 1`` rows of that request give the target's logits at each position; the
sampler draws the target's token ``y_j`` at every one of them (row ``j`` as if the drafts
before it had been accepted: seeded rows use the noise of output position ``j`` later). The
drafts ``x`` are accepted while ``y_j == x_j``; the first ``y_j`` that differs, or ``y_d``
after all ``d`` are accepted, is the target's own token. Every emitted token is therefore
exactly what sampling without drafts emits from the same noise (greedy: the argmax), so the
output distribution is the target's. For a one-hot draft (n-gram), this is the rejection
sampling rule: draft ``x`` is accepted with probability ``p(x)``; otherwise the token is drawn
from ``p`` with ``x`` removed, renormalized.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from trillm.messages import LogprobsLists
from trillm.sample.logprobs import LogprobsTensors
from trillm.sample.sampler import SamplerOutput, SamplingState
from trillm.worker.input_batch import InputBatch, StepInputs


@dataclass
class DraftStep:
    """What P3 needs of a step with drafts."""

    inputs: StepInputs
    req_ids: list[str]  # batch order
    drafts: dict[str, list[int]]  # req_id -> drafts verified this step
    num_drafts: np.ndarray  # [n] per sampling request (inputs.sample_reqs)
    row_req_ids: list[str]  # [N] the request of each logits row


def num_drafts_of(
    req_ids: list[str], drafts: dict[str, list[int]], sample_reqs: np.ndarray
) -> np.ndarray:
    """[n] drafts of each sampling request (``sample_reqs``: batch indices)."""
    return np.array([len(drafts.get(req_ids[i], ())) for i in sample_reqs.tolist()], np.int64)


def expand_rows(
    sample_rows: np.ndarray, num_drafts: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """sample_rows [n] (each request's last row), num_drafts [n] -> (rows [N], owner [N]:
    index into the n requests, offset [N]: the position's index within its request), with
    N = sum(num_drafts + 1), a request's rows in order."""
    counts = num_drafts + 1
    owner = np.repeat(np.arange(len(counts)), counts)
    starts = np.cumsum(counts) - counts  # first expanded row of each request
    offset = np.arange(int(counts.sum())) - starts[owner]
    rows = sample_rows[owner] - num_drafts[owner] + offset
    return rows.astype(np.int64), owner, offset


def num_accepted(sampled: list[int], drafts: list[int]) -> int:
    """Drafts accepted: the leading positions where the target's token equals the draft."""
    n = 0
    for y, x in zip(sampled, drafts):
        if y != x:
            break
        n += 1
    return n


def accept_drafts(
    batch: InputBatch,
    state: SamplingState,
    step: DraftStep,
    out: SamplerOutput,
    kept: np.ndarray,
    failed: dict[str, str],
) -> tuple[list[list[int]], dict[str, LogprobsLists]]:
    """P3 of a step with drafts, after every drafted position was sampled (``out``: the rows
    ``kept`` of the N rows; ``failed``: requests whose rows failed to sample): each request
    keeps its accepted drafts and the target's next token, recorded in the batch and the
    sampling state -> (tokens per batch request, logprobs of the kept tokens)."""
    position = np.full(len(step.row_req_ids), -1, dtype=np.int64)  # [N] row -> row of `out`
    position[kept] = np.arange(len(kept))
    tokens = out.sampled_token_ids.cpu().tolist()
    sampled_lists: list[list[int]] = [[] for _ in step.req_ids]
    runs: list[tuple[str, int, list[int]]] = []  # (req_id, slot, rows of `out` emitted)
    first = 0
    for j, d in enumerate(step.num_drafts.tolist()):
        rows = position[first : first + d + 1].tolist()
        first += d + 1
        req_id = step.row_req_ids[first - 1]
        if req_id in failed or min(rows) < 0:
            failed.setdefault(req_id, "a drafted position failed to sample")
            continue
        ys = [tokens[r] for r in rows]
        n = num_accepted(ys, step.drafts.get(req_id, [])) + 1
        slot = int(step.inputs.slots[step.inputs.sample_reqs[j]])
        batch.append_tokens(slot, ys[:n])
        sampled_lists[int(step.inputs.sample_reqs[j])] = ys[:n]
        runs.append((req_id, slot, rows[:n]))
    slots = [slot for _, slot, rows in runs for _ in rows]
    state.append_tokens(slots, [tokens[r] for _, _, rows in runs for r in rows])
    return sampled_lists, _run_logprobs(batch, out.logprobs, runs)


def _run_logprobs(
    batch: InputBatch, tensors: LogprobsTensors | None, runs: list[tuple[str, int, list[int]]]
) -> dict[str, LogprobsLists]:
    """Logprobs of each request's emitted run of tokens (rows of the sampler output)."""
    if tensors is None:
        return {}
    tensors = tensors.cpu()
    result = {}
    for req_id, slot, rows in runs:
        params = batch.params[slot]
        if params is not None and params.logprobs is not None:
            result[req_id] = tensors.select(rows, params.logprobs).tolists()
    return result
