"""A request's own chat template (``--trust-request-chat-template``) under a time and size
budget (issue 33, item 11).

Before: the sandbox held, but the template rendered on the event loop with no bound: a
100,000 x 3,000 nested loop left /health unanswered for 5 s; ``'x' * 300000000`` took 7.4 s
and some 300 MB. Now a request's template renders on a worker thread, metered
(``trillm/engine/template_budget.py``): past REQUEST_TEMPLATE_SECONDS, or past its character
budget (REQUEST_TEMPLATE_CHARS_FACTOR x the context's text bound, checked before a string is
built where it can be), the request is a 400 naming ``chat_template``.
"""

from __future__ import annotations

import time

import httpx
import jinja2.sandbox
import pytest
from server_harness import post_polling_health, rss_mib
from shared_servers import FAKE_512_TEMPLATES, FAKE_512_TEMPLATES_GROUP

from trillm.engine.chat_template import ChatTemplateError, render_template
from trillm.engine.preprocess import REQUEST_TEMPLATE_SECONDS
from trillm.engine.template_budget import RenderBudget

# The server is shared with the other modules of its group (tests/support/shared_servers.py).
pytestmark = pytest.mark.xdist_group(FAKE_512_TEMPLATES_GROUP)


@pytest.fixture(scope="module")
def server(shared_server):
    return shared_server(FAKE_512_TEMPLATES)


MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hello there"},
]


def chat_polling_health(server, template: str) -> tuple[httpx.Response, float, float, float]:
    """A chat with ``template`` while /health is polled: (answer, its time, the slowest
    /health, the server's largest RSS growth in MiB)."""
    body = {"messages": MESSAGES, "max_tokens": 2, "chat_template": template}
    base = rss_mib(server.proc.pid)
    growth = [0.0]

    def sample() -> None:
        growth[0] = max(growth[0], rss_mib(server.proc.pid) - base)

    answer, took, worst = post_polling_health(server, "/v1/chat/completions", body, sample)
    return answer, took, worst, growth[0]


def test_a_runaway_loop_is_stopped_at_its_deadline(server):
    template = "{% for i in range(100000) %}{% for j in range(3000) %}{% endfor %}{% endfor %}x"
    r, took, worst, _ = chat_polling_health(server, template)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "chat_template"
    assert f"longer than {REQUEST_TEMPLATE_SECONDS:g} s" in error["message"]
    assert took < REQUEST_TEMPLATE_SECONDS + 20, took  # stopped, not run to its end (~15 s+)
    assert worst < 0.3 * took, (worst, took)  # before: /health waited the whole render


def test_a_giant_string_is_refused_before_it_is_built(server):
    r, took, worst, growth = chat_polling_health(server, "{{ 'x' * 300000000 }}")
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "chat_template"
    assert "characters" in r.json()["error"]["message"]
    assert growth < 100, growth  # before: +300 MB (and a 400 naming messages after 7 s)


def test_an_ordinary_template_renders_as_plain_jinja(server):
    template = (
        "{% for m in messages %}<|{{ m['role'] }}|>{{ m.content | trim }}"
        "{% if not loop.last %}\n{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    body = {
        "messages": MESSAGES,
        "max_tokens": 2,
        "chat_template": template,
        "return_token_ids": True,
    }
    r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    ids = r.json()["prompt_token_ids"]
    text = httpx.post(server.url + "/detokenize", json={"tokens": ids}, timeout=60).json()
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    plain = env.from_string(template).render(messages=MESSAGES, add_generation_prompt=True)
    assert text["prompt"] == plain


# Each builds far more than the budget through a different door; each is refused before the
# string exists (the render takes moments, not the seconds building it would).
HOSTILE = {
    "filter width": "{{ 'x' | center(300000000) }}",
    "method width": "{{ 'x'.ljust(300000000) }}",
    "%-format width": "{{ '%0300000000d' % 1 }}",
    "str.format width": "{{ '{:>300000000}'.format(1) }}",
    "replace": "{% set s = 'x' * 100000 %}{{ s.replace('x', 'y' * 10000) }}",
    "doubling with ~": "{% set ns = namespace(s='x') %}{% for i in range(60) %}"
    "{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s | length }}",
    "doubling with +": "{% set ns = namespace(s='x') %}{% for i in range(60) %}"
    "{% set ns.s = ns.s + ns.s %}{% endfor %}{{ ns.s | length }}",
    "list of big strings": "{% set l = ['x' * 100000] %}{{ (l * 100000) | join }}",
    "mapped widths": "{{ range(100000) | map('center', 100000) | list | length }}",
    "output in loops": "{% for i in range(100000) %}{% for j in range(100000) %}"
    + "y" * 100
    + "{% endfor %}{% endfor %}",
    "huge power": "{{ 2 ** 1000000000 }}",
}


@pytest.mark.parametrize("name", list(HOSTILE))
def test_hostile_templates_are_refused_by_the_meter(name):
    budget = RenderBudget(seconds=5.0, max_chars=1_000_000)
    start = time.monotonic()
    with pytest.raises(ChatTemplateError) as err:
        render_template(HOSTILE[name], MESSAGES, budget=budget)
    assert err.value.param == "chat_template"
    assert time.monotonic() - start < 3.0


def test_a_recursive_macro_is_stopped_at_its_deadline():
    # 2**40 calls that write nothing: only the deadline can stop it (with an "x" per leaf a fast
    # host reached the size budget first)
    template = (
        "{% macro m(n) %}{% if n %}{{ m(n - 1) }}{{ m(n - 1) }}{% endif %}{% endmacro %}{{ m(40) }}"
    )
    start = time.monotonic()
    with pytest.raises(ChatTemplateError, match="longer than 0.5 s"):
        render_template(template, MESSAGES, budget=RenderBudget(seconds=0.5, max_chars=10**6))
    assert time.monotonic() - start < 5.0
