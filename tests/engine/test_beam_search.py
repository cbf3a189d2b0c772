"""``LLM.beam_search`` against transformers' ``generate(num_beams=W, do_sample=False)`` on a
tiny random checkpoint whose beams end with EOS at different lengths: the tokens of every
returned beam, their order and their scores; then the output's shape, stop strings and the
refusals."""

from __future__ import annotations

import pytest
import trio
from beam_reference import eos_prone_checkpoint, hf_beam_search
from hf_reference import load_hf_model

from trillm import LLM, BeamSearchParams, open_engine
from trillm.engine.beam_request import BeamSearchRequest
from trillm.engine.preprocess import InvalidRequestError
from trillm.sampling_params import SamplingParams, SamplingParamsError
from trillm.testing.tiny_models import EOS_IDS

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPTS = ["In the beginning", "The license grants you", "A", "Copyright holders may not"]
MAX_TOKENS = 10
# Scores are logprob sums (over 10 tokens at most) divided by a length power: float32 noise.
SCORE_TOL = 1e-4


@pytest.fixture(scope="module")
def eos_model(tiny_model_factory, tmp_path_factory):
    path = eos_prone_checkpoint(tiny_model_factory("llama"), tmp_path_factory.mktemp("eos"))
    engine = LLM(
        path, max_model_len=256, kv_cache_memory="8MiB", distributed_executor_backend="uni"
    )
    yield path, engine
    engine.shutdown()


def _token_prompts(engine: LLM) -> list[list[int]]:
    tok = engine.get_tokenizer()
    return [tok.encode(p) for p in PROMPTS]


def _check_against_transformers(path, engine, params, eos_ids) -> int:
    """Every prompt's beams equal transformers' (tokens, order, scores); returns how many
    beams ended with EOS."""
    prompts = _token_prompts(engine)
    outs = engine.beam_search([{"prompt_token_ids": ids} for ids in prompts], params)
    hf_model = load_hf_model(path)
    ended = 0
    for ids, out in zip(prompts, outs, strict=True):
        want, want_scores = hf_beam_search(
            hf_model,
            ids,
            params.beam_width,
            params.max_tokens,
            eos_ids,
            params.length_penalty,
            params.early_stopping,
        )
        got = [seq.tokens[len(ids) :] for seq in out.sequences]
        assert got == want
        penalty = params.length_penalty
        scores = [seq.cum_logprob / len(t) ** penalty for seq, t in zip(out.sequences, got)]
        assert scores == pytest.approx(want_scores, abs=SCORE_TOL)
        ended += sum(t[-1] in EOS_IDS for t in got)
    return ended


@pytest.mark.parametrize("width", [1, 2, 4])
def test_beams_equal_transformers_with_eos(eos_model, width):
    path, engine = eos_model
    params = BeamSearchParams(beam_width=width, max_tokens=MAX_TOKENS)
    ended = _check_against_transformers(path, engine, params, EOS_IDS)
    assert ended >= 1  # the EOS rule is exercised, not just the length limit


@pytest.mark.parametrize(
    ("penalty", "early_stopping"), [(0.0, False), (2.0, True), (2.0, "never"), (-0.5, False)]
)
def test_length_penalty_and_early_stopping_equal_transformers(eos_model, penalty, early_stopping):
    path, engine = eos_model
    params = BeamSearchParams(
        beam_width=4,
        max_tokens=MAX_TOKENS,
        length_penalty=penalty,
        early_stopping=early_stopping,
    )
    _check_against_transformers(path, engine, params, EOS_IDS)


def test_ignore_eos_runs_every_beam_to_max_tokens(eos_model):
    path, engine = eos_model
    params = BeamSearchParams(beam_width=3, max_tokens=MAX_TOKENS, ignore_eos=True)
    _check_against_transformers(path, engine, params, None)
    for out in engine.beam_search(PROMPTS, params):
        assert {s.finish_reason for s in out.sequences} == {"length"}


def test_output_shape(eos_model):
    """vLLM's shape: tokens = prompt + output; text = the prompt's and the output's (an EOS
    left out); per output token its candidates, the chosen one among them; cum_logprob
    their sum; finish_reason / stop_reason."""
    _, engine = eos_model
    tok = engine.get_tokenizer()
    params = BeamSearchParams(beam_width=4, max_tokens=MAX_TOKENS)
    outs = engine.beam_search(PROMPTS, params)
    reasons = set()
    for prompt, out in zip(PROMPTS, outs, strict=True):
        ids = tok.encode(prompt)
        assert len(out.sequences) == 4
        for seq in out.sequences:
            output = seq.tokens[len(ids) :]
            assert seq.tokens[: len(ids)] == ids
            assert len(seq.logprobs) == len(output)
            assert all(t in entry for t, entry in zip(output, seq.logprobs, strict=True))
            chosen = sum(e[t].logprob for t, e in zip(output, seq.logprobs, strict=True))
            assert seq.cum_logprob == pytest.approx(chosen, abs=1e-5)
            ended = output[-1] in EOS_IDS
            kept = output[:-1] if ended else output
            assert seq.text == prompt + tok.decode(kept, skip_special_tokens=True)
            assert (seq.finish_reason, seq.stop_reason) == (
                ("stop", output[-1]) if ended else ("length", None)
            )
            reasons.add(seq.finish_reason)
    assert reasons == {"stop", "length"}


def test_stop_string_ends_a_beam(eos_model):
    _, engine = eos_model
    tok = engine.get_tokenizer()
    free = engine.beam_search(["In the beginning"], BeamSearchParams(2, 8, ignore_eos=True))
    first = free[0].sequences[0]
    output = first.tokens[len(tok.encode("In the beginning")) :]
    text = tok.decode(output, skip_special_tokens=True)  # what stop strings are matched in
    stop = text[2:5]  # from the middle of the best beam's output
    for keep in (False, True):
        params = BeamSearchParams(
            2, 8, ignore_eos=True, stop=[stop], include_stop_str_in_output=keep
        )
        out = engine.beam_search(["In the beginning"], params)[0]
        stopped = [s for s in out.sequences if s.stop_reason == stop]
        assert stopped, "the best beam's own text holds the stop string"
        for seq in stopped:
            assert seq.finish_reason == "stop"
            output_text = seq.text[len("In the beginning") :]
            assert output_text.endswith(stop) if keep else stop not in output_text


def test_refusals_name_their_field(eos_model):
    _, engine = eos_model
    with pytest.raises(SamplingParamsError, match="temperature must be 0") as err:
        BeamSearchParams(beam_width=2, max_tokens=4, temperature=0.7)
    assert err.value.param == "temperature"
    with pytest.raises(SamplingParamsError, match="early_stopping"):
        BeamSearchParams(beam_width=2, max_tokens=4, early_stopping="always")
    with pytest.raises(SamplingParamsError, match="beam_width"):
        BeamSearchParams(beam_width=0, max_tokens=4)
    with pytest.raises(SamplingParamsError, match=r"length_penalty must be a number in \[-20"):
        BeamSearchParams(beam_width=2, max_tokens=4, length_penalty=1e308)  # 2 ** 1e308: inf
    # 7 beams x 3 (two EOS ids) = 21 candidates per beam, over --max-logprobs (20).
    with pytest.raises(InvalidRequestError, match="max_logprobs") as err:
        engine.beam_search(["A"], BeamSearchParams(beam_width=7, max_tokens=4))
    assert err.value.param == "n"
    with pytest.raises(ValueError, match="context"):
        engine.beam_search(["A"], BeamSearchParams(beam_width=2, max_tokens=1000))


def test_cancelled_search_aborts_its_beams(eos_model):
    """Leaving a search mid-step (a client gone) aborts the step's beams: the engine ends
    with no request left."""
    path, _ = eos_model

    async def main() -> None:
        async with open_engine(
            path, max_model_len=256, kv_cache_memory="8MiB", distributed_executor_backend="uni"
        ) as engine:
            whole = SamplingParams(n=4, max_tokens=200, temperature=0)
            prompts = [await engine.preprocessor.prepare(p, whole) for p in PROMPTS]
            params = BeamSearchParams(4, 200, ignore_eos=True)
            search = BeamSearchRequest(engine, prompts, params, ["cancel-me"] * len(PROMPTS))
            with trio.CancelScope() as scope:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(search.run)
                    while engine.output_processor.num_unfinished_requests() == 0:
                        await trio.sleep(0.001)
                    scope.cancel()
            assert not search.runs[0].search.done
            with trio.fail_after(30):
                while (
                    engine.output_processor.has_unfinished_requests()
                    or engine.cores[0].scheduler.has_unfinished_requests()
                ):
                    await trio.sleep(0.01)

    trio.run(main)


def test_timeout_ends_the_search_with_its_beams_as_they_stand(eos_model):
    """The request's deadline (HTTP ``timeout``) ends the search: the beams it holds then
    come back with finish_reason "timeout" (240 tokens at 0.1 s would take 2,400 steps/s)."""
    path, _ = eos_model

    async def main() -> list[tuple[int, str | None]]:
        async with open_engine(
            path, max_model_len=256, kv_cache_memory="8MiB", distributed_executor_backend="uni"
        ) as engine:
            whole = SamplingParams(n=2, max_tokens=240, temperature=0)
            prompt = await engine.preprocessor.prepare("A", whole)
            params = BeamSearchParams(2, 240, ignore_eos=True)
            search = BeamSearchRequest(engine, [prompt], params, ["late"], timeout=0.1)
            async with search as items:
                _, out = await items.__anext__()
            assert not isinstance(out, Exception)
            return [(len(c.token_ids), c.finish_reason) for c in out.outputs]

    beams = trio.run(main)
    assert beams and all(n < 240 and reason == "timeout" for n, reason in beams)


@pytest.mark.parametrize("penalty", [1.0, 0.0, -0.5])
def test_a_search_ended_before_its_first_token_returns_its_empty_beam(penalty):
    """A deadline reached before the first step: the one running beam comes back as it
    stands (no tokens, score 0), whatever the length penalty (0 ** p was a division by zero)."""
    from trillm.engine.beam_search import PromptSearch

    search = PromptSearch(BeamSearchParams(2, 8, length_penalty=penalty), 1, lambda _: None, False)
    best = search.best()
    assert len(best) == 1 and best[0].score == 0.0 and best[0].beam.tokens == []
