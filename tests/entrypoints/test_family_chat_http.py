"""One HTTP chat per newer model family, in the family's own chat format: DeepSeek-V3 (MLA),
Llama 4, gpt-oss (harmony), Bamba, Granite 4.0-H and Nemotron-H (hybrid state space; Nemotron-H
with the ChatML template its tiny checkpoint ships). The server renders the family's template
with its special tokens, and the greedy answer (official ``openai`` client) equals
transformers' generation from the prompt transformers' own ``apply_chat_template`` renders:
prompt ids and output ids alike."""

from __future__ import annotations

import openai
import pytest
from hf_reference import hf_greedy
from server_harness import ServerProcess

from trillm.testing.family_chat import with_family_chat

MAX_TOKENS = 8
SYSTEM = {"role": "system", "content": "You answer briefly."}
USER = {"role": "user", "content": "Hello there, what is the capital of France?"}


def _deepseek(tmp):
    from trillm.testing.tiny_deepseek import build_tiny_deepseek

    return with_family_chat(build_tiny_deepseek("v3", tmp / "src"), tmp / "model", "deepseek_v3")


def _llama4(tmp):
    from trillm.testing.tiny_llama4 import build_tiny_llama4

    return with_family_chat(build_tiny_llama4(tmp / "src"), tmp / "model", "llama4")


def _bamba(tmp):
    from trillm.testing.tiny_bamba import build_tiny_bamba

    return with_family_chat(build_tiny_bamba(tmp / "src"), tmp / "model", "granite")


def _granite_hybrid(tmp):
    from trillm.testing.tiny_bamba import build_tiny_granite_hybrid

    return with_family_chat(build_tiny_granite_hybrid(tmp / "src"), tmp / "model", "granite")


def _nemotron_h(tmp):
    from trillm.testing.tiny_nemotron_h import build_tiny_nemotron_h

    return build_tiny_nemotron_h(tmp / "model")


def _gpt_oss(tmp):
    from trillm.testing.tiny_harmony import build_harmony_gpt_oss

    return build_harmony_gpt_oss(tmp / "model")


FAMILIES = {
    "deepseek_v3": (_deepseek, [SYSTEM, USER]),
    "llama4": (_llama4, [SYSTEM, USER]),
    "gpt_oss": (_gpt_oss, [USER]),
    "bamba": (_bamba, [SYSTEM, USER]),
    "granite_hybrid": (_granite_hybrid, [SYSTEM, USER]),
    "nemotron_h": (_nemotron_h, [SYSTEM, USER]),
}


def _template_ids(folder, messages) -> list[int]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(folder))
    rendered = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tok(rendered, add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_chat_in_the_familys_format_equals_transformers(family, tmp_path):
    build, messages = FAMILIES[family]
    folder = build(tmp_path)
    prompt_ids = _template_ids(folder, messages)
    markers = FAMILIES_MARKERS.get(family)
    if markers:  # the family's markers are single special tokens of the prompt
        from transformers import AutoTokenizer

        vocab = AutoTokenizer.from_pretrained(str(folder)).get_vocab()
        assert all(vocab[m] in prompt_ids for m in markers), markers
    srv = ServerProcess([str(folder), "--max-model-len", "256"], tmp_path / "server.log").start()
    try:
        client = openai.OpenAI(base_url=srv.base_url, api_key="none", timeout=120)
        answer = client.chat.completions.create(
            model=str(folder),
            messages=messages,
            max_tokens=MAX_TOKENS,
            temperature=0,
            extra_body={"return_token_ids": True, "ignore_eos": True},
        )
    finally:
        assert srv.stop() == 0, srv.log()
    data = answer.model_dump()
    assert data["prompt_token_ids"] == prompt_ids
    assert data["usage"]["prompt_tokens"] == len(prompt_ids)
    assert data["choices"][0]["token_ids"] == hf_greedy(str(folder), prompt_ids, MAX_TOKENS)


FAMILIES_MARKERS = {
    "deepseek_v3": ["<｜User｜>", "<｜Assistant｜>"],
    "llama4": ["<|header_start|>", "<|eot|>"],
    "bamba": ["<|start_of_role|>", "<|end_of_text|>"],
    "granite_hybrid": ["<|start_of_role|>", "<|end_of_role|>"],
    "nemotron_h": ["<|im_start|>", "<|im_end|>"],
}
