"""Chat-template rendering in a sandboxed Jinja environment (server and Python API).

Templates come from the tokenizer (``tokenizer.chat_template``), from ``--chat-template`` (a
file path or the template text), or, when the server trusts it, from the request. They run in
``ImmutableSandboxedEnvironment``: no attribute access to Python internals, no mutation of the
objects handed in, so a template cannot reach the process.
"""

from __future__ import annotations

import functools
import os
from datetime import datetime
from typing import Any

import jinja2
import jinja2.sandbox


class ChatTemplateError(ValueError):
    """The chat cannot be rendered: no template, a template error, or unsupported content."""

    def __init__(self, message: str, param: str | None = "messages") -> None:
        super().__init__(message)
        self.param = param


def load_chat_template(value: str | None) -> str | None:
    """``--chat-template``: a path to a Jinja file, or the template text itself."""
    if value is None:
        return None
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            return f.read()
    if any(marker in value for marker in ("{{", "{%")):
        return value
    raise ChatTemplateError(
        f"--chat-template {value!r} is neither a readable file nor a Jinja template.", None
    )


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@functools.lru_cache(maxsize=32)
def compile_template(source: str) -> jinja2.Template:
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source)
    except jinja2.TemplateError as exc:
        raise ChatTemplateError(f"The chat template does not compile: {exc}", None) from exc


def content_text(content: Any, index: int) -> str:
    """A message's content as one string: a string, or a list of ``{type: text}`` parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else getattr(part, "type", None)
        text = part.get("text") if isinstance(part, dict) else getattr(part, "text", None)
        if kind != "text" or not isinstance(text, str):
            raise ChatTemplateError(
                f"Only text content parts are supported; messages[{index}].content[{j}] has "
                f"type {kind!r}.",
                f"messages[{index}].content[{j}].type",
            )
        texts.append(text)
    return "\n".join(texts)


def normalize_messages(messages: list[Any]) -> list[dict[str, Any]]:
    """Messages (dicts or protocol objects) as plain dicts with string content."""
    out = []
    for i, m in enumerate(messages):
        role = m.get("role") if isinstance(m, dict) else m.role
        content = m.get("content") if isinstance(m, dict) else m.content
        msg: dict[str, Any] = {"role": role, "content": content_text(content, i)}
        name = m.get("name") if isinstance(m, dict) else getattr(m, "name", None)
        if name is not None:
            msg["name"] = name
        out.append(msg)
    return out


def render_chat(
    tokenizer: Any,
    messages: list[Any],
    *,
    chat_template: str | None = None,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    chat_template_kwargs: dict[str, Any] | None = None,
) -> str:
    """Render ``messages`` with ``chat_template`` (a path or template text; default: the
    tokenizer's) to the prompt text the model expects. Raises ChatTemplateError."""
    template = load_chat_template(chat_template) or tokenizer_chat_template(tokenizer)
    return render_template(
        template,
        messages,
        add_generation_prompt=add_generation_prompt,
        continue_final_message=continue_final_message,
        special_tokens=tokenizer_special_tokens(tokenizer),
        template_kwargs=chat_template_kwargs,
    )


def tokenizer_chat_template(tokenizer: Any) -> str | None:
    template = getattr(tokenizer, "chat_template", None)
    return template if isinstance(template, str) else None


def render_template(
    template: str | None,
    messages: list[Any],
    *,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    special_tokens: dict[str, Any] | None = None,
    template_kwargs: dict[str, Any] | None = None,
) -> str:
    """Render ``messages`` with the template *text* ``template``."""
    if template is None:
        raise ChatTemplateError(
            "The model has no chat template; start the server with --chat-template.", None
        )
    if continue_final_message and add_generation_prompt:
        raise ChatTemplateError(
            "add_generation_prompt and continue_final_message cannot both be true.",
            "continue_final_message",
        )
    msgs = normalize_messages(messages)
    if continue_final_message and (not msgs or msgs[-1]["role"] != "assistant"):
        raise ChatTemplateError(
            "continue_final_message needs a final assistant message.", "continue_final_message"
        )
    context = {**(template_kwargs or {}), **(special_tokens or {})}
    context.update(messages=msgs, add_generation_prompt=add_generation_prompt)
    try:
        text = compile_template(template).render(**context)
    except ChatTemplateError:
        raise
    except jinja2.TemplateError as exc:  # includes the sandbox's SecurityError
        raise ChatTemplateError(f"The chat template failed to render: {exc}", None) from exc
    except Exception as exc:  # a template can raise TypeError and friends on odd input
        raise ChatTemplateError(f"The chat template failed to render: {exc}", None) from exc
    if continue_final_message:
        text = _cut_after_final_message(text, msgs[-1]["content"])
    return text


def _cut_after_final_message(text: str, final: str) -> str:
    # NOTE: the template closes the last message (e.g. with <|im_end|>); continuing it means
    # dropping everything rendered after its content.
    if not final:
        raise ChatTemplateError(
            "continue_final_message needs a non-empty final message.", "continue_final_message"
        )
    at = text.rfind(final)
    if at < 0:
        raise ChatTemplateError(
            "The final message does not appear verbatim in the rendered chat.",
            "continue_final_message",
        )
    return text[: at + len(final)]


def tokenizer_special_tokens(tokenizer: Any) -> dict[str, Any]:
    """bos/eos/pad/unk tokens as templates expect them (``{{ bos_token }}``)."""
    names = ("bos_token", "eos_token", "pad_token", "unk_token")
    return {n: getattr(tokenizer, n, None) or "" for n in names}
