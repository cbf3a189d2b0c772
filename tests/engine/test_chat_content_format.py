"""vLLM's ``--chat-template-content-format``: "auto" gives a template that loops over a
message's content the parts list (as transformers' ``apply_chat_template`` passes it, an image
as ``{"type": "image"}``), and other templates the parts' text joined by newlines, as before."""

from __future__ import annotations

import pytest

from trillm.engine.chat_template import (
    ChatTemplateError,
    detect_content_format,
    render_template,
)
from trillm.testing.tiny_gemma3 import CHAT_TEMPLATE as GEMMA3_TEMPLATE

# Qwen2-VL's own template (vision ids off): an image part writes its vision span
QWEN2_VL_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}"
    "{{ message['content'] }}<|im_end|>\n{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "<|vision_start|><|image_pad|><|vision_end|>{% elif 'text' in content %}"
    "{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + "
    "message['content'] + '<|im_end|>' + '\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"
CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is it?"}]},
    {"role": "assistant", "content": "A cat."},
    {"role": "user", "content": [{"type": "text", "text": "And"}, {"type": "text", "text": "?"}]},
]


def hf_render(template: str, messages: list) -> str:
    from transformers import AutoTokenizer

    from trillm.testing.tiny_models import DEFAULT_MODEL_DIR

    tok = AutoTokenizer.from_pretrained(str(DEFAULT_MODEL_DIR))
    return tok.apply_chat_template(
        messages, chat_template=template, tokenize=False, add_generation_prompt=True
    )


def render(template: str, content_format: str, messages: list = CHAT) -> str:
    return render_template(
        template, messages, content_format=content_format, image_placeholder=PLACEHOLDER
    )


@pytest.mark.parametrize(
    ("template", "expected"),
    [
        (QWEN2_VL_TEMPLATE, "openai"),
        (GEMMA3_TEMPLATE, "openai"),
        (CHATML, "string"),
        ("{% for m in messages %}{% set c = m.content %}{% for p in c %}{% endfor %}{% endfor %}",
         "openai"),  # through a variable set to it
        ("{% for m in messages %}{% for p in m['content'] | list %}{% endfor %}{% endfor %}",
         "openai"),  # through a filter
        ("{% for m in messages %}{{ m['content'] }}{% endfor %}{% for t in tools %}{% endfor %}",
         "string"),
        ("{% for m in messages %", "string"),  # (does not compile: rendering says so)
    ],
)  # fmt: skip
def test_auto_detects_templates_that_loop_over_content(template, expected):
    assert detect_content_format(template) == expected


@pytest.mark.parametrize("template", [QWEN2_VL_TEMPLATE, GEMMA3_TEMPLATE])
def test_a_template_looping_over_parts_renders_as_transformers_does(template):
    ours = render(template, "auto")
    assert ours == hf_render(template, CHAT) == render(template, "openai")
    assert f"{PLACEHOLDER}What is it?" in ours or "<start_of_image>What is it?" in ours


def test_the_string_format_joins_parts_with_newlines_as_before():
    ours = render(QWEN2_VL_TEMPLATE, "string")
    assert f"user\n{PLACEHOLDER}\nWhat is it?<|im_end|>" in ours
    assert "user\nAnd\n?<|im_end|>" in ours
    assert (
        render(CHATML, "auto")
        == render(CHATML, "string")
        == hf_render(
            CHATML, [{**m, "content": c} for m, c in zip(CHAT, _joined(CHAT), strict=True)]
        )
    )


def _joined(chat: list) -> list[str]:
    out = []
    for m in chat:
        content = m["content"]
        if not isinstance(content, str):
            content = "\n".join(p.get("text", PLACEHOLDER) for p in content)
        out.append(content)
    return out


def test_parts_a_template_cannot_take_are_refused_by_name():
    bad = [{"role": "user", "content": [{"type": "audio_url", "audio_url": {"url": "x"}}]}]
    for content_format in ("openai", "string"):
        with pytest.raises(ChatTemplateError, match="type 'audio_url'") as info:
            render(QWEN2_VL_TEMPLATE, content_format, bad)
        assert info.value.param == "messages[0].content[0].type"
    image = [{"role": "user", "content": [{"type": "image"}]}]
    with pytest.raises(ChatTemplateError, match="type 'image'"):  # a text-only model
        render_template(QWEN2_VL_TEMPLATE, image, content_format="openai")


def test_continue_final_message_in_the_openai_format():
    chat = [*CHAT[:3], {"role": "assistant", "content": [{"type": "text", "text": "It is"}]}]
    text = render_template(
        QWEN2_VL_TEMPLATE,
        chat,
        add_generation_prompt=False,
        continue_final_message=True,
        content_format="auto",
        image_placeholder=PLACEHOLDER,
    )
    assert text.endswith("<|im_start|>assistant\nIt is")
