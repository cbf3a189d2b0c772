"""The blocking ``LLM`` API and the Trio API's input checks, on a real tiny model."""

from __future__ import annotations

import pytest
import trio
from hf_reference import hf_greedy

from trillm import LLM, SamplingParams, open_engine
from trillm.engine.preprocess import InvalidRequestError
from trillm.sampling_params import SamplingParamsError


@pytest.fixture(scope="module")
def llm(tiny_model_factory):
    path = tiny_model_factory("qwen2")
    engine = LLM(
        path, max_model_len=256, kv_cache_memory="8MiB", distributed_executor_backend="uni"
    )
    yield path, engine
    engine.shutdown()


def test_generate_returns_outputs_in_input_order(llm):
    path, engine = llm
    tok = engine.get_tokenizer()
    prompts = ["In the beginning", "The license grants", "Copyright holders may", "A"]
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    outs = engine.generate(prompts, params, use_tqdm=False)
    assert [o.prompt for o in outs] == prompts
    for prompt, out in zip(prompts, outs, strict=True):
        ids = tok.encode(prompt)
        assert out.prompt_token_ids == ids
        assert out.outputs[0].token_ids == hf_greedy(path, ids, 10)
        assert out.outputs[0].text == tok.decode(out.outputs[0].token_ids, skip_special_tokens=True)
        assert out.finished and out.outputs[0].finish_reason == "length"


def test_per_prompt_params_and_n(llm):
    _, engine = llm
    outs = engine.generate(
        ["one", "two"],
        [SamplingParams(max_tokens=3, ignore_eos=True), SamplingParams(max_tokens=5, n=3, seed=7)],
        use_tqdm=False,
    )
    assert len(outs[0].outputs[0].token_ids) == 3
    assert [c.index for c in outs[1].outputs] == [0, 1, 2]
    with pytest.raises(ValueError, match="sampling params for 3 prompts"):
        engine.generate(["a", "b", "c"], [SamplingParams(), SamplingParams()])


def test_chat_renders_the_template(llm):
    _, engine = llm
    messages = [{"role": "user", "content": "Hello there"}]
    out = engine.chat(messages, SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)[0]
    rendered = "<|im_start|>user\nHello there<|im_end|>\n<|im_start|>assistant\n"
    assert out.prompt == rendered
    assert out.prompt_token_ids == engine.get_tokenizer().encode(rendered)


# Renders "True" per message whose content reaches it as a string, "False" for a parts list.
CONTENT_IS_STRING = "{% for m in messages %}{{ m['content'] is string }}{% endfor %}"


@pytest.mark.parametrize(
    "content_format,rendered", [("string", "True"), ("openai", "False"), ("auto", "True")]
)
def test_chat_takes_vllms_chat_template_content_format(llm, content_format, rendered):
    _, engine = llm
    messages = [{"role": "user", "content": [{"type": "text", "text": "Hello"}]}]
    out = engine.chat(
        messages,
        SamplingParams(max_tokens=1),
        use_tqdm=False,
        chat_template=CONTENT_IS_STRING,
        chat_template_content_format=content_format,
    )[0]
    assert out.prompt == rendered


def test_chat_refuses_an_unknown_content_format(llm):
    _, engine = llm
    with pytest.raises(ValueError, match="chat_template_content_format must be one of"):
        engine.chat(
            [{"role": "user", "content": "Hi"}],
            use_tqdm=False,
            chat_template_content_format="parts",
        )


def test_bad_inputs_raise_clear_errors(tiny_model_factory):
    path = tiny_model_factory("qwen2")

    async def main():
        async with open_engine(
            path, max_model_len=64, num_gpu_blocks_override=8, distributed_executor_backend="uni"
        ) as engine:
            cases = [
                ({"prompt_token_ids": list(range(3, 70))}, SamplingParams(), InvalidRequestError),
                ("hi", SamplingParams(max_tokens=100), InvalidRequestError),
                ({"prompt_token_ids": [1, 99999]}, SamplingParams(), InvalidRequestError),
                ("", SamplingParams(), InvalidRequestError),
                ("hi", SamplingParams(logprobs=50), SamplingParamsError),
                ("hi", SamplingParams(allowed_token_ids=[10**6]), SamplingParamsError),
            ]
            for prompt, params, exc in cases:
                with pytest.raises(exc):
                    async with engine.generate(prompt, params) as outputs:
                        async for _ in outputs:
                            pass
            assert engine.num_blocks == 8
            # After six refusals the engine still serves.
            params = SamplingParams(max_tokens=8, ignore_eos=True)
            async with engine.generate("still serving", params) as outputs:
                async for out in outputs:
                    pass
            return out

    out = trio.run(main)
    assert len(out.outputs[0].token_ids) == 8
