"""P3's pieces on the worker: the step P2 leaves for P3, grammar bitmasks applied to logits,
sampling that isolates a failing row, and the logprobs lists of a step (``token_sampler.py``
sequences them)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from trillm.messages import LogprobsLists
from trillm.model_executor.registry import CausalLM
from trillm.sample.logprobs import LogprobsTensors, compute_topk_logprobs
from trillm.sample.sampler import SamplerOutput
from trillm.utils import cdiv
from trillm.worker.input_batch import InputBatch, StepInputs

logger = logging.getLogger(__name__)

Bitmask = dict[str, bytes | list[int]]  # req_id -> int32 words (bytes) or the words


@dataclass
class PromptLogprobsWork:
    req_id: str
    rows: slice  # rows of the pending prompt logits
    num_logprobs: int


@dataclass
class PendingStep:
    """What P2 leaves for P3."""

    step_id: int
    req_ids: list[str]  # batch order
    inputs: StepInputs
    sample_logits: torch.Tensor  # [n, V] float32, rows of inputs.sample_reqs
    prompt_logits: torch.Tensor | None  # [m, V] float32
    prompt_targets: torch.Tensor | None  # [m] long, the prompt token each row scores
    prompt_work: list[PromptLogprobsWork] = field(default_factory=list)
    start_time: float = 0.0
    failed: dict[str, str] = field(default_factory=dict)  # new requests the batch refused
    # Speculative decoding: req_id -> drafts verified this step; per sampling request its
    # draft count [n], and per logits row its request (index into the n) and offset [N].
    drafts: dict[str, list[int]] = field(default_factory=dict)
    num_drafts: np.ndarray | None = None
    row_owner: np.ndarray | None = None
    row_offset: np.ndarray | None = None


# (logits [n, V], slots [n], mask [n, W] or None, step offsets or None) -> the rows' output
SampleFn = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor | None, list[int] | None], SamplerOutput
]


def sample_isolated(
    sample: SampleFn,
    logits: torch.Tensor,  # [n, V]
    slots: np.ndarray,  # [n]
    mask: torch.Tensor | None,  # [n, W] or None
    req_ids: list[str],
    offsets: list[int] | None = None,
) -> tuple[SamplerOutput, np.ndarray, dict[str, str]]:
    """The batch sampled at once; if that raises, row by row, so that a row whose request
    makes the sampler fail fails alone -> (output of the kept rows, kept row indices,
    req_id -> why for the failed ones)."""
    slots_t = torch.from_numpy(slots)
    try:
        return sample(logits, slots_t, mask, offsets), np.arange(len(req_ids)), {}
    except Exception:
        logger.exception("sampling a batch of %d failed; sampling row by row", len(req_ids))
    outs: list[SamplerOutput] = []
    kept: list[int] = []
    failed: dict[str, str] = {}
    for i, req_id in enumerate(req_ids):
        row = slice(i, i + 1)
        try:
            outs.append(
                sample(
                    logits[row],
                    slots_t[row],
                    None if mask is None else mask[row],
                    None if offsets is None else offsets[row],
                )
            )
            kept.append(i)
        except Exception as exc:
            failed[req_id] = f"{type(exc).__name__}: {exc}"
    return concat_outputs(outs), np.array(kept, dtype=np.int64), failed


def bitmask_tensor(
    bitmask: Bitmask | None,
    req_ids: list[str],
    logits: torch.Tensor,  # [n, V]
    vocab_size: int,
    device: torch.device,
) -> torch.Tensor | None:  # [n, ceil(V / 32)] int32, all bits set for unconstrained rows
    """The grammar rows of the sampled requests, applied first (before any processor, and
    before logprobs, as vLLM). fp32 logits on the CPU are masked here, in place, with numpy
    (one single-threaded pass: torch's elementwise ops wake its thread pool, several ms on a
    busy CPU) and None is returned; otherwise the words go to the sampler."""
    if not bitmask:
        return None
    rows = [(i, bitmask[r]) for i, r in enumerate(req_ids) if r in bitmask]
    if not rows:
        return None
    vocab = logits.shape[1]
    words = cdiv(vocab_size, 32)
    packed = np.zeros((len(rows), words), dtype=np.int32)  # absent words: nothing allowed
    for k, (_, row) in enumerate(rows):
        # A row is the int32 words' bytes (what the engine sends) or a list of words.
        if isinstance(row, bytes | bytearray | memoryview):
            got = np.frombuffer(row, dtype=np.int32)
        else:
            got = np.asarray(row, dtype=np.int64).astype(np.int32)
        n = min(words, len(got))  # a tokenizer larger than the model: cut
        packed[k, :n] = got[:n]
    if logits.device.type == "cpu" and logits.dtype == torch.float32:
        allowed = np.unpackbits(packed.view(np.uint8), axis=1, bitorder="little")[:, :vocab]
        lg = logits.numpy()
        if len(rows) == len(req_ids):
            np.putmask(lg, allowed == 0, np.float32(-np.inf))
        else:
            for k, (i, _) in enumerate(rows):
                np.putmask(lg[i], allowed[k] == 0, np.float32(-np.inf))
        return None
    mask = np.full((len(req_ids), words), -1, dtype=np.int32)
    mask[[i for i, _ in rows]] = packed
    return torch.from_numpy(mask).to(device)


def sample_logprobs(
    tensors: LogprobsTensors | None,
    req_ids: list[str],
    num_logprobs: list[int | None],  # per row: its request's logprobs (None: not asked)
) -> dict[str, LogprobsLists]:
    if tensors is None:
        return {}
    tensors = tensors.cpu()
    return {
        req_id: tensors.select([i], k).tolists()
        for i, (req_id, k) in enumerate(zip(req_ids, num_logprobs))
        if k is not None
    }


def prompt_logprobs(pending: PendingStep) -> dict[str, LogprobsLists]:
    if pending.prompt_logits is None or pending.prompt_targets is None:
        return {}
    k = max(w.num_logprobs for w in pending.prompt_work)
    tensors = compute_topk_logprobs(pending.prompt_logits, pending.prompt_targets, k).cpu()
    return {w.req_id: tensors.select(w.rows, w.num_logprobs).tolists() for w in pending.prompt_work}


def concat_outputs(outs: list[SamplerOutput]) -> SamplerOutput:
    """Row-by-row sampler outputs as one (logprobs: every row has the same k, the state's)."""
    if not outs:
        return SamplerOutput(torch.empty(0, dtype=torch.long), None)
    lps = [o.logprobs for o in outs if o.logprobs is not None]
    logprobs = None
    if lps:
        logprobs = LogprobsTensors(
            token_ids=torch.cat([lp.token_ids for lp in lps]),
            logprobs=torch.cat([lp.logprobs for lp in lps]),
            ranks=torch.cat([lp.ranks for lp in lps]),
        )
    return SamplerOutput(torch.cat([o.sampled_token_ids for o in outs]), logprobs)


def prompt_logprobs_inputs(
    batch: InputBatch,
    model: CausalLM,
    pending: PendingStep,
    hidden: torch.Tensor,  # [T, H] the step's last hidden states
    num_scheduled: np.ndarray,  # [R]
    recomputed: np.ndarray,  # [R] bool: past their prompt, computed again (longrope)
) -> None:
    """Logits of this step's prompt rows for requests with prompt_logprobs (row p scores
    prompt token p + 1), into ``pending``."""
    inputs = pending.inputs
    rows: list[np.ndarray] = []
    targets: list[np.ndarray] = []
    scaled: list[tuple[slice, float]] = []  # prompt_logprobs_temperature's rows
    offset = 0
    for i in np.nonzero(batch.wants_prompt_logprobs[inputs.slots])[0].tolist():
        slot = int(inputs.slots[i])
        params = batch.params[slot]
        if params is None or params.prompt_logprobs is None or recomputed[i]:
            continue
        start = int(inputs.context_lens[i])
        end = min(start + int(num_scheduled[i]), int(batch.num_prompt_tokens[slot]) - 1)
        if end <= start:
            continue
        first_row = int(inputs.query_start_loc[i])
        rows.append(np.arange(first_row, first_row + end - start))
        targets.append(batch.token_ids[slot, start + 1 : end + 1])
        work = PromptLogprobsWork(
            pending.req_ids[i], slice(offset, offset + end - start), params.prompt_logprobs
        )
        pending.prompt_work.append(work)
        if params.prompt_logprobs_temperature is not None:
            scaled.append((work.rows, params.prompt_logprobs_temperature))
        offset += end - start
    if not rows:
        return
    row_index = torch.from_numpy(np.concatenate(rows)).to(hidden.device)
    pending.prompt_logits = model.compute_logits(hidden.index_select(0, row_index)).float()
    for rows_of, temperature in scaled:
        scale_logits(pending.prompt_logits[rows_of], temperature)
    prompt_targets = np.concatenate(targets).astype(np.int64)
    pending.prompt_targets = torch.from_numpy(prompt_targets).to(hidden.device)


def scale_logits(logits: torch.Tensor, temperature: float) -> None:
    """``logits`` [m, V] divided by ``temperature`` in place, for the same log_softmax: each
    row less its largest value first (the largest becomes 0, the rest stay <= 0) and held
    within float32, so a tiny temperature gives very negative, finite logprobs, never NaN."""
    logits.sub_(logits.amax(dim=-1, keepdim=True)).div_(temperature)
    logits.clamp_(min=torch.finfo(torch.float32).min)
