"""The batched sampler (P3): every processor against a slow per-row reference written here,
the samplers statistically (fixed seeds, so the runs are deterministic). Logprobs:
test_sampler_logprobs.py; SamplingParams validation: test_sampling_params.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from logits import CPU, random_logits

from trillm.sample.bad_words import banned_tokens
from trillm.sample.bitmask import num_words, pack_token_ids, unpack_bitmask
from trillm.sample.race import hash_mix
from trillm.sample.sampler import Sampler, SamplingState, SlotError
from trillm.sampling_params import SamplingParams

NEG_INF = float("-inf")


@pytest.fixture(autouse=True)
def _seed_global_rng():
    torch.manual_seed(1234)


def make_state(params_per_slot: dict[int, SamplingParams], vocab: int, max_reqs: int = 0):
    state = SamplingState(max(max_reqs, max(params_per_slot) + 1), vocab, CPU)
    for slot, params in params_per_slot.items():
        state.add_request(slot, params, prompt_token_ids=[], output_token_ids=[])
    return state


def slots_of(*slots: int) -> torch.Tensor:
    return torch.tensor(slots, dtype=torch.long)


def draws(sampler, logits, state, slots, times: int) -> torch.Tensor:
    """[times, n] sampled ids, without appending (the state stays the same)."""
    return torch.stack(
        [sampler(logits, state, slots, None).sampled_token_ids for _ in range(times)]
    )


def total_variation(samples: torch.Tensor, probs: torch.Tensor) -> float:
    counts = torch.bincount(samples.flatten(), minlength=probs.numel()).double()
    return 0.5 * (counts / counts.sum() - probs.double()).abs().sum().item()


# ---------------------------------------------------------------------------- greedy / random


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.0),  # read-only: no copy is made
        SamplingParams(temperature=0.0, logit_bias={3: 5.0}),
        SamplingParams(temperature=0.0, repetition_penalty=1.3),
        SamplingParams(temperature=0.7, seed=1),
        SamplingParams(temperature=1.0, top_k=5, top_p=0.8),
    ],
    ids=["greedy", "greedy-bias", "greedy-penalty", "random", "top-k-p"],
)
def test_the_callers_logits_are_never_modified(params):
    logits = random_logits(4, 50)
    before = logits.clone()
    state = make_state({s: params for s in range(4)}, 50)
    out = Sampler()(logits, state, torch.arange(4), None)
    assert torch.equal(logits, before)
    if params.temperature == 0.0 and params.logit_bias is None and params.repetition_penalty == 1:
        assert torch.equal(out.sampled_token_ids, before.argmax(dim=-1))


def test_greedy_is_argmax_of_the_logits():
    logits = random_logits(16, 100)
    state = make_state({s: SamplingParams(temperature=0.0) for s in range(16)}, 100)
    out = Sampler()(logits, state, torch.arange(16), None)
    assert state.all_greedy
    assert torch.equal(out.sampled_token_ids, logits.argmax(dim=-1))
    assert out.sampled_token_ids.dtype == torch.long
    assert out.logprobs is None


def test_temperature_matches_softmax_of_scaled_logits():
    vocab, n, temperature = 10, 4000, 0.7
    base = torch.linspace(-2.0, 2.0, vocab)
    logits = base.expand(n, vocab).clone()
    state = make_state({s: SamplingParams(temperature=temperature) for s in range(n)}, vocab)
    samples = draws(Sampler(), logits, state, torch.arange(n), times=5)  # 20k draws
    expected = torch.softmax(base / temperature, dim=-1)
    untempered = torch.softmax(base, dim=-1)
    assert total_variation(samples, expected) < 0.02
    # The bound is tight enough to tell temperature 0.7 from 1.0.
    assert total_variation(samples, untempered) > 0.08


def test_greedy_and_random_rows_in_one_batch():
    vocab, n = 20, 64
    logits = random_logits(n, vocab, seed=1, scale=1.0)
    params = {
        s: SamplingParams(temperature=0.0) if s % 2 else SamplingParams(temperature=1.5)
        for s in range(n)
    }
    state = make_state(params, vocab)
    assert not state.all_greedy and not state.all_random
    samples = draws(Sampler(), logits, state, torch.arange(n), times=20)  # [20, n]
    greedy_rows = torch.arange(1, n, 2)
    random_rows = torch.arange(0, n, 2)
    assert torch.equal(samples[:, greedy_rows], logits[greedy_rows].argmax(-1).expand(20, -1))
    # Random rows with flat-ish logits do not always pick the argmax.
    hits = (samples[:, random_rows] == logits[random_rows].argmax(-1)).float().mean().item()
    assert hits < 0.6


# ---------------------------------------------------------------------------- top-k / top-p / min-p


def reference_top_k(row: torch.Tensor, k: int) -> set[int]:
    return set(row.topk(k).indices.tolist())


def reference_nucleus(row: torch.Tensor, p: float) -> set[int]:
    probs = torch.softmax(row.double(), dim=-1)
    order = probs.argsort(descending=True).tolist()
    kept, mass = [], 0.0
    for token in order:
        kept.append(token)
        mass += probs[token].item()
        if mass >= p:
            break
    return set(kept)


def test_top_k_never_emits_outside_the_top_k():
    vocab, n = 50, 200
    logits = random_logits(n, vocab, seed=2, scale=1.0)
    ks = [1 + (s % 7) for s in range(n)]
    state = make_state({s: SamplingParams(top_k=ks[s]) for s in range(n)}, vocab)
    assert state.any_top_k and not state.any_top_p and state.max_top_k == 7
    samples = draws(Sampler(), logits, state, torch.arange(n), times=10)  # 2000 draws
    for row in range(n):
        allowed = reference_top_k(logits[row], ks[row])
        assert set(samples[:, row].tolist()) <= allowed
    # Rows with k = 7 do use more than their argmax.
    assert len(set(samples[:, 6].tolist()) | set(samples[:, 13].tolist())) > 2


def test_top_k_with_disabled_rows_keeps_those_rows_whole():
    vocab, n = 8, 2000
    base = 0.1 * torch.arange(vocab, dtype=torch.float32)
    logits = base.expand(n, vocab).clone()
    params = {s: SamplingParams(top_k=2 if s % 2 else 0) for s in range(n)}
    state = make_state(params, vocab)
    samples = draws(Sampler(), logits, state, torch.arange(n), times=1)[0]
    assert len(set(samples[0::2].tolist())) == vocab  # near-uniform over all 8
    assert set(samples[1::2].tolist()) == {6, 7}


def test_top_p_never_emits_outside_the_nucleus():
    vocab, n = 50, 200
    logits = random_logits(n, vocab, seed=3, scale=2.0)
    ps = [0.3 + 0.1 * (s % 6) for s in range(n)]
    state = make_state({s: SamplingParams(top_p=ps[s]) for s in range(n)}, vocab)
    samples = draws(Sampler(), logits, state, torch.arange(n), times=10)
    outside_argmax = 0
    for row in range(n):
        nucleus = reference_nucleus(logits[row], ps[row])
        emitted = set(samples[:, row].tolist())
        assert emitted <= nucleus
        outside_argmax += len(emitted - {logits[row].argmax().item()})
    assert outside_argmax > 50


@pytest.mark.parametrize(("k", "p"), [(6, 0.75), (3, 0.9)])  # p binds / k binds
def test_top_k_and_top_p_together_renormalise_the_survivors(k, p):
    vocab, n = 12, 2000
    base = torch.linspace(0.0, 3.0, vocab)
    logits = base.expand(n, vocab).clone()
    state = make_state({s: SamplingParams(top_k=k, top_p=p) for s in range(n)}, vocab)
    samples = draws(Sampler(), logits, state, torch.arange(n), times=10)
    # Reference: keep the top k, then the nucleus of the renormalised top k.
    top = base.topk(k).indices
    restricted = torch.full((vocab,), NEG_INF)
    restricted[top] = base[top]
    kept = sorted(reference_nucleus(restricted, p))
    expected = torch.zeros(vocab)
    expected[kept] = torch.softmax(base[kept], dim=-1)
    assert set(samples.flatten().tolist()) == set(kept)
    assert total_variation(samples, expected) < 0.02


def test_min_p_drops_tokens_below_the_scaled_top_probability():
    vocab, n = 40, 200
    logits = random_logits(n, vocab, seed=4, scale=1.5)
    min_ps = [0.05 + 0.05 * (s % 4) for s in range(n)]
    state = make_state({s: SamplingParams(min_p=min_ps[s]) for s in range(n)}, vocab)
    samples = draws(Sampler(), logits, state, torch.arange(n), times=10)
    probs = torch.softmax(logits, dim=-1)
    distinct = 0
    for row in range(n):
        threshold = min_ps[row] * probs[row].max().item()
        emitted = samples[:, row]
        assert (probs[row, emitted] >= threshold).all()
        distinct += len(set(emitted.tolist()))
    assert distinct > 2 * n


# ---------------------------------------------------------------------------- penalties etc.


def reference_penalties(row, prompt, output, rep, freq, pres):
    row = row.clone()
    counts: dict[int, int] = {}
    for token in output:
        counts[token] = counts.get(token, 0) + 1
    for token in range(row.numel()):
        value = row[token].item()
        if token in counts or token in prompt:
            value = value / rep if value > 0 else value * rep
        value -= freq * counts.get(token, 0)
        value -= pres * (1.0 if token in counts else 0.0)
        row[token] = value
    return row


def test_penalties_follow_the_formulas():
    vocab = 30
    cases = [
        ([1, 2, 3], [4, 4, 5], SamplingParams(repetition_penalty=1.3)),
        ([1, 2, 3], [4, 4, 5], SamplingParams(frequency_penalty=0.7)),
        ([7], [4, 4, 4, 9], SamplingParams(presence_penalty=-0.4)),
        (
            [0, 29],
            [29, 29, 1],
            SamplingParams(repetition_penalty=0.8, frequency_penalty=-1.1, presence_penalty=1.9),
        ),
        ([5, 6], [6, 6], SamplingParams()),  # a row without penalties in the same batch
    ]
    state = SamplingState(8, vocab, CPU)
    slots = [6, 0, 3, 7, 2]
    for slot, (prompt, output, params) in zip(slots, cases):
        # Half of the output arrives with the request (preemption), the rest one by one.
        half = len(output) // 2
        state.add_request(slot, params, prompt, output[:half])
        for token in output[half:]:
            state.append_token(slot, token)
    logits = random_logits(len(cases), vocab, seed=5)
    got = Sampler().process_logits(logits, state, slots_of(*slots))
    for row, (prompt, output, p) in enumerate(cases):
        want = reference_penalties(
            logits[row],
            set(prompt),
            output,
            p.repetition_penalty,
            p.frequency_penalty,
            p.presence_penalty,
        )
        torch.testing.assert_close(got[row], want, rtol=1e-6, atol=1e-5)
    assert torch.equal(got[4], logits[4])


def test_batched_append_counts_repeated_tokens():
    state = SamplingState(4, 10, CPU)
    state.add_request(1, SamplingParams(frequency_penalty=1.0), [], [])
    state.add_request(2, SamplingParams(frequency_penalty=1.0), [], [3])
    state.append_tokens(torch.tensor([1, 2, 1, 1]), torch.tensor([5, 3, 5, 6]))
    assert state.output_counts[1, 5].item() == 2
    assert state.output_counts[1, 6].item() == 1
    assert state.output_counts[2, 3].item() == 2
    assert state.num_output_tokens(1) == 3 and state.num_output[1].item() == 3
    assert state.num_output_tokens(2) == 2


def test_output_counts_saturate_instead_of_wrapping():
    state = SamplingState(2, 10, CPU)
    state.add_request(0, SamplingParams(frequency_penalty=1.0), [], [])
    state.output_counts[0, 4] = 32766
    state.append_tokens([0, 0, 0], [4, 4, 4])
    assert 32000 < state.output_counts[0, 4].item() <= 32767


def test_slot_reuse_clears_the_previous_request():
    state = SamplingState(2, 10, CPU)
    state.add_request(0, SamplingParams(repetition_penalty=2.0, logit_bias={3: 5.0}), [1], [2])
    state.remove_request(0)
    assert not state.any_penalties and not state.any_logit_bias
    state.add_request(0, SamplingParams(frequency_penalty=1.0), [], [])
    logits = torch.ones(1, 10)
    got = Sampler().process_logits(logits, state, slots_of(0))
    assert torch.equal(got, logits)


def test_logit_bias_adds_to_the_named_tokens():
    vocab = 20
    state = SamplingState(4, vocab, CPU)
    state.add_request(0, SamplingParams(logit_bias={3: 5.0, 7: -100.0}), [], [])
    state.add_request(1, SamplingParams(), [], [])
    state.add_request(2, SamplingParams(logit_bias={i: 0.5 * i for i in range(10)}), [], [])
    logits = random_logits(3, vocab, seed=6)
    got = Sampler().process_logits(logits, state, slots_of(0, 1, 2))
    want = logits.clone()
    want[0, 3] += 5.0
    want[0, 7] -= 100.0
    want[2, :10] += 0.5 * torch.arange(10)
    torch.testing.assert_close(got, want)


def test_allowed_token_ids_mask_everything_else():
    vocab, n = 40, 100
    allowed = [3, 17, 31]
    params = {
        s: SamplingParams(allowed_token_ids=allowed) if s < n // 2 else SamplingParams()
        for s in range(n)
    }
    state = make_state(params, vocab)
    logits = random_logits(n, vocab, seed=7, scale=0.5)
    got = Sampler().process_logits(logits, state, torch.arange(n))
    outside = torch.ones(vocab, dtype=torch.bool)
    outside[allowed] = False
    assert torch.isneginf(got[: n // 2, outside]).all()
    assert torch.equal(got[: n // 2, allowed], logits[: n // 2, allowed])
    assert torch.equal(got[n // 2 :], logits[n // 2 :])
    samples = draws(Sampler(), logits, state, torch.arange(n), times=5)
    assert set(samples[:, : n // 2].flatten().tolist()) == set(allowed)


def test_banned_tokens_reference_cases():
    assert banned_tokens([[5]], []) == [5]
    assert banned_tokens([[1, 2, 3]], [9, 1, 2]) == [3]
    assert banned_tokens([[1, 2, 3]], [1, 2, 9]) == []
    assert banned_tokens([[1, 2, 3]], [2]) == []
    assert banned_tokens([[4, 3], [7]], [4]) == [3, 7]


def test_bad_words_single_and_multi_token():
    vocab = 16
    bad = [[5], [1, 2, 3]]
    state = SamplingState(4, vocab, CPU)
    state.add_request(2, SamplingParams(bad_words_token_ids=bad), [], [9, 1])
    state.add_request(0, SamplingParams(), [], [1, 2])
    sampler = Sampler()
    logits = torch.zeros(2, vocab)
    got = sampler.process_logits(logits, state, slots_of(2, 0))
    assert torch.isneginf(got[0, 5]) and not torch.isneginf(got[0, 3])
    assert not torch.isneginf(got[1]).any()  # slot 0 has no bad words
    state.append_token(2, 2)  # output now ends with [1, 2]
    got = sampler.process_logits(logits, state, slots_of(2, 0))
    assert torch.isneginf(got[0, 3]) and torch.isneginf(got[0, 5])
    assert torch.isneginf(got[0]).sum().item() == 2
    # Sampling never emits a banned token.
    for _ in range(50):
        token = sampler(logits, state, slots_of(2, 0), None).sampled_token_ids[0].item()
        assert token not in (3, 5)


def test_min_tokens_suppresses_stop_ids_until_reached():
    vocab, eos, stop = 12, 11, 4
    params = SamplingParams(
        min_tokens=3, stop_token_ids=[stop], all_stop_token_ids=[eos, stop], temperature=0.0
    )
    state = SamplingState(2, vocab, CPU)
    state.add_request(1, params, [0], [])
    logits = torch.zeros(1, vocab)
    logits[0, eos] = 10.0
    logits[0, stop] = 9.0
    sampler = Sampler()
    emitted = []
    for _ in range(5):
        token = sampler(logits, state, slots_of(1), None).sampled_token_ids[0].item()
        emitted.append(token)
        state.append_token(1, token)
    assert emitted[:3] != [eos] * 3 and eos not in emitted[:3] and stop not in emitted[:3]
    assert emitted[3:] == [eos, eos]
    assert not state.any_min_tokens  # the flag clears once reached


# ---------------------------------------------------------------------------- seeds


def run_seeded(
    slot: int,
    others: dict[int, SamplingParams],
    steps: int,
    batch_first: bool,
    vocab: int = 64,
    seed: int = 42,
) -> list[int]:
    state = SamplingState(16, vocab, CPU)
    state.add_request(slot, SamplingParams(seed=seed, temperature=1.0, top_p=0.9), [1, 2], [])
    for other_slot, params in others.items():
        state.add_request(other_slot, params, [3], [])
    order = [slot, *others] if batch_first else [*others, slot]
    row = order.index(slot)
    sampler = Sampler()
    tokens = []
    for step in range(steps):
        logits = random_logits(len(order), vocab, seed=100 + step, scale=1.0)
        logits[row] = random_logits(1, vocab, seed=1000 + step, scale=1.0)[0]
        out = sampler(logits, state, torch.tensor(order), None).sampled_token_ids
        tokens.append(out[row].item())
        state.append_tokens(torch.tensor(order), out)
    return tokens


def test_seeded_requests_reproduce_across_batches_and_slots():
    alone = run_seeded(3, {}, steps=12, batch_first=True)
    torch.manual_seed(999)  # a different global stream for the unseeded neighbours
    crowded = run_seeded(
        7,
        {0: SamplingParams(), 1: SamplingParams(temperature=0.0), 9: SamplingParams(seed=5)},
        steps=12,
        batch_first=False,
    )
    assert alone == crowded
    assert run_seeded(3, {}, steps=12, batch_first=True, seed=43) != alone


def test_seeded_request_resumes_after_preemption():
    vocab = 64
    params = SamplingParams(seed=7, temperature=0.8)
    sampler = Sampler()
    logits_at = [random_logits(1, vocab, seed=200 + i, scale=1.0) for i in range(8)]

    def run(state, slot, start, end):
        out = []
        for i in range(start, end):
            token = sampler(logits_at[i], state, slots_of(slot), None).sampled_token_ids
            out.append(token.item())
            state.append_tokens(slots_of(slot), token)
        return out

    state = SamplingState(4, vocab, CPU)
    state.add_request(0, params, [1], [])
    full = run(state, 0, 0, 8)
    resumed_state = SamplingState(4, vocab, CPU)
    resumed_state.add_request(2, params, [1], full[:5])  # preempted after 5 tokens
    assert run(resumed_state, 2, 5, 8) == full[5:]


def test_hash_mix_separates_seeds_and_steps():
    values = {hash_mix(seed, step) for seed in range(-3, 30) for step in range(30)}
    assert len(values) == 33 * 30
    assert all(0 <= v < 2**64 for v in values)


# ---------------------------------------------------------------------------- bitmask


def reference_pack(token_ids, vocab) -> list[int]:
    words = [0] * num_words(vocab)
    for t in token_ids:
        words[t // 32] |= 1 << (t % 32)
    return [w - (1 << 32) if w >= 1 << 31 else w for w in words]  # as int32


def test_pack_and_unpack_match_the_bit_layout():
    vocab = 70
    ids = [0, 1, 31, 32, 63, 64, 69]
    packed = pack_token_ids(ids, vocab)
    assert packed.dtype == np.int32 and packed.tolist() == reference_pack(ids, vocab)
    unpacked = unpack_bitmask(torch.from_numpy(packed).unsqueeze(0), vocab)[0]
    assert unpacked.nonzero().flatten().tolist() == ids


def test_structured_output_bitmask_masks_logits_and_samples():
    vocab, n = 100, 64
    gen = torch.Generator().manual_seed(10)
    allowed_sets = [
        sorted(torch.randperm(vocab, generator=gen)[: 3 + r % 5].tolist()) for r in range(n)
    ]
    bitmask = torch.tensor([reference_pack(a, vocab) for a in allowed_sets], dtype=torch.int32)
    state = make_state(
        {s: SamplingParams(temperature=0.0 if s % 3 == 0 else 1.0) for s in range(n)}, vocab
    )
    logits = random_logits(n, vocab, seed=11)
    got = Sampler().process_logits(logits, state, torch.arange(n), bitmask)
    sampler = Sampler()
    for _ in range(10):
        out = sampler(logits, state, torch.arange(n), bitmask).sampled_token_ids
        for row in range(n):
            assert out[row].item() in allowed_sets[row]
    for row in range(n):
        finite = (~torch.isneginf(got[row])).nonzero().flatten().tolist()
        assert finite == allowed_sets[row]


# ---------------------------------------------------------------------------- state bookkeeping


def test_flags_follow_adds_and_removes():
    state = SamplingState(4, 50, CPU)
    assert state.all_greedy and state.max_num_logprobs is None
    state.add_request(0, SamplingParams(temperature=0.0, top_k=5, logprobs=2), [], [])
    assert state.all_greedy and not state.any_top_k  # greedy rows normalise their filters
    state.add_request(1, SamplingParams(top_k=5, top_p=0.5, min_p=0.1, seed=1), [], [])
    assert not state.all_greedy and state.any_top_k and state.any_top_p and state.any_min_p
    assert state.any_seeded and state.max_num_logprobs == 2
    state.remove_request(1)
    assert state.all_greedy and not (state.any_top_k or state.any_top_p or state.any_seeded)
    state.remove_request(0)
    assert state.max_num_logprobs is None and state.num_active == 0


def test_slot_errors():
    state = SamplingState(2, 10, CPU)
    state.add_request(0, SamplingParams(), [], [])
    with pytest.raises(SlotError, match="already taken"):
        state.add_request(0, SamplingParams(), [], [])
    with pytest.raises(SlotError, match="outside"):
        state.add_request(2, SamplingParams(), [], [])
    with pytest.raises(SlotError, match="holds no request"):
        state.remove_request(1)
    with pytest.raises(SlotError, match="holds no request"):
        state.append_token(1, 3)


# ---------------------------------------------------------------------------- device


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_matches_cpu_for_greedy_logprobs_and_penalties():
    vocab, n = 1000, 8
    cuda = torch.device("cuda")
    logits = random_logits(n, vocab, seed=12)
    outs = []
    for device in (CPU, cuda):
        state = SamplingState(n, vocab, device)
        for slot in range(n):
            params = SamplingParams(
                temperature=0.0, repetition_penalty=1.2, frequency_penalty=0.3, logprobs=2
            )
            state.add_request(slot, params, [1, 2, 3], [4, 4])
        outs.append(Sampler()(logits.to(device), state, torch.arange(n), None))
    assert torch.equal(outs[0].sampled_token_ids, outs[1].sampled_token_ids.cpu())
    torch.testing.assert_close(outs[0].logprobs.logprobs, outs[1].logprobs.logprobs.cpu())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_seeded_request_reproduces_in_other_batches():
    assert run_seeded_on(torch.device("cuda"), 3, n=1) == run_seeded_on(
        torch.device("cuda"), 9, n=12
    )


def run_seeded_on(device: torch.device, slot: int, n: int, vocab: int = 500) -> list[int]:
    state = SamplingState(16, vocab, device)
    for s in range(n):
        seed = 11 if s == 0 else None
        state.add_request((slot + s) % 16, SamplingParams(seed=seed, top_k=50), [], [])
    slots = torch.tensor([(slot + s) % 16 for s in range(n)])
    sampler, tokens = Sampler(), []
    for step in range(6):
        logits = random_logits(n, vocab, seed=300 + step, scale=1.0)
        logits[0] = random_logits(1, vocab, seed=400 + step, scale=1.0)[0]
        out = sampler(logits.to(device), state, slots, None).sampled_token_ids
        tokens.append(out[0].item())
        state.append_tokens(slots, out)
    return tokens


def test_seeded_helper_reproduces_on_cpu():
    assert run_seeded_on(CPU, 3, n=1) == run_seeded_on(CPU, 9, n=12)
