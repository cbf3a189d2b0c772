"""Chat-template rendering in a sandboxed Jinja environment (stage 2, used by the engine's
``Preprocessor`` for the server and the Python API).

Templates come from the tokenizer (``tokenizer.chat_template``), from ``--chat-template`` (a
file path or the template text), or, when the server trusts it, from the request. They run in
``ImmutableSandboxedEnvironment``: no attribute access to Python internals, no mutation of the
objects handed in, so a template cannot reach the process.
"""

from __future__ import annotations

import functools
import json
import os
from datetime import datetime
from typing import TYPE_CHECKING, Any

import jinja2
import jinja2.nodes
import jinja2.sandbox

from trillm.engine.template_budget import (
    BudgetedSandbox,
    RenderBudget,
    TemplateBudgetError,
    render_budgeted,
)

if TYPE_CHECKING:
    from trillm.tokenizer_protocol import Tokenizer

IMAGE_PART = "image"  # an image content part as templates see it: {"type": "image"}
AUDIO_PART = "audio"  # an audio content part as templates see it: {"type": "audio"}


# vLLM's --chat-template-content-format values (and LLM.chat's chat_template_content_format).
CONTENT_FORMATS = ("auto", "string", "openai")


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


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: Any = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


@functools.lru_cache(maxsize=32)
def compile_template(source: str, budgeted: bool = False) -> jinja2.Template:
    """``source`` compiled in the sandbox; ``budgeted``: in the metered one, to be rendered
    with ``template_budget.render_budgeted`` (a request's own template)."""
    sandbox = BudgetedSandbox if budgeted else jinja2.sandbox.ImmutableSandboxedEnvironment
    env = sandbox(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    # Hugging Face's tojson: plain json.dumps (Jinja's own escapes <, >, & and ' for HTML,
    # which would change the tool schemas and call arguments the model sees).
    env.filters["tojson"] = _tojson
    if isinstance(env, BudgetedSandbox):
        env.finish_setup()
    try:
        return env.from_string(source)
    except jinja2.TemplateError as exc:
        raise ChatTemplateError(f"The chat template does not compile: {exc}", None) from exc


def content_parts(
    content: Any, index: int, images: bool = False, audio: bool = False
) -> list[dict[str, str]]:
    """A message's content as the parts a template iterates (vLLM's "openai" content format):
    ``{"type": "text", "text": ...}`` and, where ``images``, ``{"type": "image"}`` (an image
    part, its placeholder left to the template; ``audio``: ``{"type": "audio"}`` alike); a
    string is one text part."""
    if content is None:
        return []
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    parts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else getattr(part, "type", None)
        text = part.get("text") if isinstance(part, dict) else getattr(part, "text", None)
        if (kind == IMAGE_PART and images) or (kind == AUDIO_PART and audio):
            parts.append({"type": kind})
        elif kind == "text" and isinstance(text, str):
            parts.append({"type": "text", "text": text})
        else:
            raise ChatTemplateError(
                f"Only text content parts are supported; messages[{index}].content[{j}] has "
                f"type {kind!r}.",
                f"messages[{index}].content[{j}].type",
            )
    return parts


def content_text(
    content: Any,
    index: int,
    image_placeholder: str | None = None,
    audio_placeholder: str | None = None,
) -> str:
    """A message's content as one string (vLLM's "string" content format): a string, or its
    parts joined by newlines, an image (audio) part as the model's ``image_placeholder``
    (``audio_placeholder``)."""
    if isinstance(content, str):
        return content
    placeholders = {IMAGE_PART: image_placeholder, AUDIO_PART: audio_placeholder}
    parts = content_parts(
        content, index, image_placeholder is not None, audio_placeholder is not None
    )
    return "\n".join(
        p["text"] if p["type"] == "text" else str(placeholders[p["type"]]) for p in parts
    )


def detect_content_format(template: str) -> str:
    """vLLM's ``--chat-template-content-format auto``: "openai" when the template loops over
    a message's content (``{% for part in message['content'] %}``, directly or through a
    variable set to it), else "string"."""
    return _detect_content_format(template)


@functools.lru_cache(maxsize=32)
def _detect_content_format(template: str) -> str:
    try:
        tree = jinja2.Environment(extensions=["jinja2.ext.loopcontrols"]).parse(template)
    except jinja2.TemplateSyntaxError:
        return "string"  # (rendering reports the error)
    aliases = {
        node.target.name
        for node in tree.find_all(jinja2.nodes.Assign)
        if isinstance(node.target, jinja2.nodes.Name) and _is_content(node.node, set())
    }
    loops = tree.find_all(jinja2.nodes.For)
    return "openai" if any(_is_content(loop.iter, aliases) for loop in loops) else "string"


def _is_content(node: jinja2.nodes.Node, aliases: set[str]) -> bool:
    """``node`` is ``x['content']`` / ``x.content`` (through filters), or a name set to it."""
    while isinstance(node, jinja2.nodes.Filter) and node.node is not None:
        node = node.node
    if isinstance(node, jinja2.nodes.Getitem):
        return isinstance(node.arg, jinja2.nodes.Const) and node.arg.value == "content"
    if isinstance(node, jinja2.nodes.Getattr):
        return node.attr == "content"
    return isinstance(node, jinja2.nodes.Name) and node.name in aliases


def _get(obj: Any, key: str) -> Any:
    return obj.get(key) if isinstance(obj, dict) else getattr(obj, key, None)


def normalize_messages(
    messages: list[Any],
    content_format: str = "string",
    image_placeholder: str | None = None,
    audio_placeholder: str | None = None,
) -> list[dict[str, Any]]:
    """Messages (dicts or protocol objects) as plain dicts with string content (the "string"
    content format; "openai": a list of parts), keeping what templates read besides:
    ``name``, an assistant's ``tool_calls`` (arguments as objects, as Hugging Face templates
    expect), a tool message's ``tool_call_id``, ``reasoning_content``."""
    out = []
    for i, m in enumerate(messages):
        content = _get(m, "content")
        msg: dict[str, Any] = {
            "role": _get(m, "role"),
            "content": content_parts(
                content, i, image_placeholder is not None, audio_placeholder is not None
            )
            if content_format == "openai"
            else content_text(content, i, image_placeholder, audio_placeholder),
        }
        for key in ("name", "tool_call_id"):
            value = _get(m, key)
            if value is not None:
                msg[key] = value
        reasoning = _get(m, "reasoning_content") or _get(m, "reasoning")
        if reasoning is not None:
            msg["reasoning_content"] = reasoning
        tool_calls = _get(m, "tool_calls")
        if tool_calls:
            msg["tool_calls"] = [_tool_call(tc, i, j) for j, tc in enumerate(tool_calls)]
        out.append(msg)
    return out


def _tool_call(tc: Any, i: int, j: int) -> dict[str, Any]:
    where = f"messages[{i}].tool_calls[{j}]"
    fn = _get(tc, "function")
    name = _get(fn, "name") if fn is not None else None
    if not isinstance(name, str):
        raise ChatTemplateError(f"'{where}.function.name' must be a string.", f"{where}.function")
    arguments = _get(fn, "arguments")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError as exc:
            raise ChatTemplateError(
                f"'{where}.function.arguments' is not valid JSON: {exc}.",
                f"{where}.function.arguments",
            ) from None
    elif arguments is None:
        arguments = {}
    call: dict[str, Any] = {
        "type": _get(tc, "type") or "function",
        "function": {"name": name, "arguments": arguments},
    }
    if _get(tc, "id") is not None:
        call["id"] = _get(tc, "id")
    return call


def normalize_tools(tools: list[Any] | None) -> list[dict[str, Any]] | None:
    """Tools (dicts or protocol objects) as the JSON-schema dicts templates expect, without
    the unset (None) fields so ``is defined`` tests in templates see what the client sent."""
    if tools is None:
        return None
    out = []
    for tool in tools:
        if isinstance(tool, dict):
            out.append(tool)
            continue
        fn = tool.function
        function = {
            k: v
            for k, v in (
                ("name", fn.name),
                ("description", fn.description),
                ("parameters", fn.parameters),
                ("strict", fn.strict),
            )
            if v is not None
        }
        out.append({"type": tool.type, "function": function})
    return out


def tokenizer_chat_template(tokenizer: Tokenizer) -> str | None:
    """The tokenizer's template; None without one, or with named ones (a dict)."""
    template = tokenizer.chat_template
    return template if isinstance(template, str) else None


def render_template(
    template: str | None,
    messages: list[Any],
    *,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    special_tokens: dict[str, Any] | None = None,
    template_kwargs: dict[str, Any] | None = None,
    tools: list[Any] | None = None,
    documents: list[dict[str, Any]] | None = None,
    budget: RenderBudget | None = None,
    content_format: str = "string",
    image_placeholder: str | None = None,
    audio_placeholder: str | None = None,
) -> str:
    """Render ``messages`` with the template *text* ``template``; ``tools`` and ``documents``
    reach it as Hugging Face's ``apply_chat_template`` passes them. With a ``budget`` (a
    request's own template) the render is metered (``template_budget``); past the budget it
    raises ChatTemplateError naming ``chat_template``. ``content_format`` (vLLM's
    ``--chat-template-content-format``: auto, string, openai) is how message content reaches
    the template; ``image_placeholder`` (``audio_placeholder``): what an image (audio) part is
    in the "string" format (None: such parts are refused)."""
    if template is None:
        raise ChatTemplateError(
            "The model has no chat template; start the server with --chat-template.", None
        )
    if continue_final_message and add_generation_prompt:
        raise ChatTemplateError(
            "add_generation_prompt and continue_final_message cannot both be true.",
            "continue_final_message",
        )
    if content_format not in CONTENT_FORMATS:
        raise ChatTemplateError(
            f"chat_template_content_format must be one of {', '.join(CONTENT_FORMATS)}, got "
            f"{content_format!r}.",
            "chat_template_content_format",
        )
    if content_format == "auto":
        content_format = detect_content_format(template)
    msgs = normalize_messages(messages, content_format, image_placeholder, audio_placeholder)
    if continue_final_message and (not msgs or msgs[-1]["role"] != "assistant"):
        raise ChatTemplateError(
            "continue_final_message needs a final assistant message.", "continue_final_message"
        )
    context = {**(template_kwargs or {}), **(special_tokens or {})}
    context.update(messages=msgs, add_generation_prompt=add_generation_prompt)
    # NOTE: None when not given, as transformers renders: a template testing `tools is not
    # none` must not see Undefined (which is "not none").
    if tools is not None or "tools" not in context:
        context["tools"] = normalize_tools(tools)
    if documents is not None or "documents" not in context:
        context["documents"] = documents
    try:
        if budget is None:
            text = compile_template(template).render(**context)
        else:
            text = render_budgeted(compile_template(template, True), budget, context)
    except ChatTemplateError:
        raise
    except TemplateBudgetError as exc:
        raise ChatTemplateError(str(exc), "chat_template") from None
    except jinja2.TemplateError as exc:  # includes the sandbox's SecurityError
        raise ChatTemplateError(f"The chat template failed to render: {exc}", None) from exc
    except Exception as exc:  # a template can raise TypeError and friends on odd input
        raise ChatTemplateError(f"The chat template failed to render: {exc}", None) from exc
    if continue_final_message:
        final = msgs[-1]["content"]
        if isinstance(final, list):  # the "openai" format: its last text part ends it
            final = next((p["text"] for p in reversed(final) if p["type"] == "text"), "")
        text = _cut_after_final_message(text, final)
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


def tokenizer_special_tokens(tokenizer: Tokenizer) -> dict[str, str]:
    """bos/eos/pad/unk tokens as templates expect them (``{{ bos_token }}``)."""
    return {
        "bos_token": tokenizer.bos_token or "",
        "eos_token": tokenizer.eos_token or "",
        "pad_token": tokenizer.pad_token or "",
        "unk_token": tokenizer.unk_token or "",
    }
