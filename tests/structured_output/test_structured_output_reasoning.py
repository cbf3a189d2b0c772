"""Structured outputs on reasoning models (issue 12): the constraint starts after the reasoning
section ends (vLLM's structured-outputs ``reasoning_parser``).

A tiny model whose tokenizer has ``<think>`` / ``</think>`` as added special tokens. The
manager: no row and no matcher input while a request reasons, the tokens after ``</think>``
fed, a prompt that already closed reasoning constrained from the first token, qwen3 with no tag
in the prompt: the first row also allows ``<think>``. The engine (scripted runner: the
output is known, so where a constraint applied is visible; and the real tiny model). HTTP with
``--reasoning-parser qwen3``: ``reasoning_content`` holds the thinking, ``content`` parses as
the schema, a named tool's arguments come after the reasoning; a tokenizer without the tags is
refused at startup (qwen3 accepts it, refusing structured outputs per request).
"""

from __future__ import annotations

import json
import re
import time
from types import SimpleNamespace

import jsonschema
import openai
import pytest
import trio
from server_harness import ServerProcess

from trillm import LLM, SamplingParams, open_engine
from trillm.sampling_params import StructuredOutputsParams as SO
from trillm.structured_output import GrammarCache, StructuredOutputManager
from trillm.testing.scripted_runner import SCRIPT_FILE

SCRIPTED = "trillm.testing.scripted_runner:ScriptedRunner"
CITY = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 12}},
    "required": ["city"],
    "additionalProperties": False,
}
THINKING = "Let me think."
ANSWER = '{"city": "Paris"}'


@pytest.fixture(scope="module")
def think_model(tiny_model_factory, tmp_path_factory):
    """(folder, tokenizer, <think> id, </think> id): a qwen3 tiny model whose vocabulary
    (4112) holds the two added special tokens (4096, 4097)."""
    from transformers import AutoTokenizer

    from trillm.testing.reasoning_model import build_reasoning_model

    src = tiny_model_factory("qwen3", vocab_size=4112)
    out, start, end = build_reasoning_model(src, tmp_path_factory.mktemp("think") / "model")
    assert (start, end) == (4096, 4097)
    return str(out), AutoTokenizer.from_pretrained(str(out)), start, end


def ids(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


# ---------------------------------------------------------------- the manager


def manager(tok, parser: str | None = "qwen3") -> StructuredOutputManager:
    return StructuredOutputManager(GrammarCache(tok, 4112, [2, 0]), parser)


def add(mgr: StructuredOutputManager, req_id: str, params: SO, prompt: list[int]) -> None:
    if not mgr.add_request(req_id, params, prompt):  # compiling on the grammar thread
        while mgr.has_pending:
            time.sleep(0.005)
            assert not mgr.poll()[1]


def rows(mgr: StructuredOutputManager, *req_ids: str) -> dict:
    sched = SimpleNamespace(step_id=0, num_scheduled_tokens=dict.fromkeys(req_ids, 1))
    return mgr.fill_bitmask(sched, lambda r: True).bitmask  # type: ignore[arg-type]


def allows(row: bytes, token: int) -> bool:
    return bool(
        (int.from_bytes(row[4 * (token >> 5) : 4 * (token >> 5) + 4], "little") >> (token & 31)) & 1
    )


def test_no_row_and_no_matcher_input_while_reasoning(think_model):
    _, tok, start, end = think_model
    mgr = manager(tok)
    params = SO(choice=["yes", "no"])
    prompt = [*ids(tok, "q"), start]  # the prompt opened reasoning
    add(mgr, "r", params, prompt)
    add(mgr, "plain-json", params, [*ids(tok, "q"), start, 5, end])
    assert mgr.is_reasoning("r") and not mgr.is_reasoning("plain-json")
    got = rows(mgr, "r", "plain-json")
    assert list(got) == ["plain-json"]  # reasoning: no row (no constraint)
    # "maybe" is outside the grammar: fed to the matcher it would end the request
    assert mgr.accept_tokens("r", ids(tok, "maybe")) == (True, False)
    assert mgr.is_reasoning("r") and list(rows(mgr, "r")) == []
    # </think> ends the reasoning; the tokens after it in the same step are fed
    assert mgr.accept_tokens("r", [*ids(tok, "so"), end, *ids(tok, "n")]) == (True, False)
    assert not mgr.is_reasoning("r")
    row = rows(mgr, "r")["r"]
    assert allows(row, ids(tok, "o")[0]) and not allows(row, ids(tok, "y")[0])
    assert mgr.accept_tokens("r", ids(tok, "o")) == (True, False)
    assert mgr.accept_tokens("r", [2]) == (True, True)  # EOS: terminated
    # outside the grammar after the reasoning: refused (the engine aborts it)
    assert mgr.accept_tokens("plain-json", ids(tok, "maybe"))[0] is False


def test_prompt_that_ended_reasoning_is_constrained_from_the_first_token(think_model):
    _, tok, start, end = think_model
    for parser in ("qwen3", "deepseek_r1"):
        mgr = manager(tok, parser)
        # Qwen3 with enable_thinking=False renders <think>\n\n</think>\n\n in the prompt
        prompt = [*ids(tok, "q"), start, *ids(tok, "\n\n"), end, *ids(tok, "\n\n")]
        add(mgr, "r", SO(choice=["yes"]), prompt)
        row = rows(mgr, "r")["r"]
        assert not allows(row, start) and not allows(row, end)
        assert mgr.accept_tokens("r", ids(tok, "maybe"))[0] is False


def test_prompt_without_a_tag_depends_on_the_parser(think_model):
    _, tok, start, end = think_model
    # deepseek_r1: the output starts in reasoning (R1 writes its thinking first)
    r1 = manager(tok, "deepseek_r1")
    add(r1, "r", SO(choice=["yes"]), ids(tok, "q"))
    assert r1.is_reasoning("r") and rows(r1, "r") == {}
    # qwen3: the first token is <think> (reasoning) or the constrained content at once
    for first, reasoning in ((start, True), (ids(tok, "y")[0], False)):
        q3 = manager(tok, "qwen3")
        add(q3, "r", SO(choice=["yes"]), ids(tok, "q"))
        row = rows(q3, "r")["r"]
        assert allows(row, start) and allows(row, ids(tok, "y")[0])
        assert not allows(row, end) and not allows(row, ids(tok, "n")[0])
        assert q3.accept_tokens("r", [first]) == (True, False)
        assert q3.is_reasoning("r") is reasoning
        if reasoning:
            assert rows(q3, "r") == {}
        else:  # a late <think> is content: outside the grammar once constrained
            assert not allows(rows(q3, "r")["r"], start)
    # no parser: constrained from the first token whatever the prompt holds
    plain = manager(tok, None)
    add(plain, "r", SO(choice=["yes"]), [start])
    assert not allows(rows(plain, "r")["r"], start)


def test_state_dropped_with_the_request(think_model):
    _, tok, start, _ = think_model
    mgr = manager(tok)
    add(mgr, "a", SO(choice=["x"]), [start])
    add(mgr, "b", SO(choice=["x"]), [start])
    mgr.remove("a")
    mgr.retain(lambda r: False)
    assert not mgr.is_reasoning("a") and not mgr.is_reasoning("b")


def test_tokenizer_without_the_tags_is_refused(tok):
    with pytest.raises(ValueError, match=r"parser 'deepseek_r1'.*no <think> and </think>"):
        StructuredOutputManager(GrammarCache(tok, 4096, [2, 0]), "deepseek_r1")
    # qwen3 matches its tags in the text (vLLM 0.32): accepted, structured outputs refused
    q3 = StructuredOutputManager(GrammarCache(tok, 4096, [2, 0]), "qwen3")
    assert q3.tags_missing and q3.think_ids == (-1, -1)
    with pytest.raises(ValueError, match=r"qwen3 reasoning parser need <think> and </think>"):
        trio.run(q3.precompile, SO(choice=["yes"]))
    with pytest.raises(ValueError, match="Unknown reasoning parser 'nope'"):
        StructuredOutputManager(GrammarCache(tok, 4096, [2, 0]), "nope")


def test_enable_in_reasoning_needs_no_end_tag(tok):
    """With enable_in_reasoning the grammar applies from the first token, as in vLLM: a
    tokenizer without the tags (qwen3) and a parser whose reasoning ends at a multi-token
    header (openai_gptoss) take structured outputs, constrained from the first step."""
    from trillm.config.structured_outputs import parse_structured_outputs_config

    config = parse_structured_outputs_config({"enable_in_reasoning": True})
    for parser in ("qwen3", "openai_gptoss"):
        mgr = StructuredOutputManager(GrammarCache(tok, 4096, [2, 0]), parser, config)
        trio.run(mgr.precompile, SO(choice=["yes"]))
        add(mgr, "r", SO(choice=["yes"]), ids(tok, "q"))
        assert not mgr.is_reasoning("r") and list(rows(mgr, "r")) == ["r"]
        assert mgr.accept_tokens("r", ids(tok, "maybe"))[0] is False  # not free text


# ---------------------------------------------------------------- the engine


def run_engine(path: str, script: list[int], requests: dict, **engine_args):
    """{name: (prompt ids, params)} through an engine with the scripted runner ->
    ({name: CompletionOutput}, {name: [whether a step sent it a row, for each of its steps]})."""
    scheduled: list[list[str]] = []
    seen: dict[str, list[bool]] = {name: [] for name in requests}

    async def main():
        async with open_engine(
            path,
            runner=SCRIPTED,
            runner_kwargs={"script": script},
            distributed_executor_backend="uni",
            max_model_len=256,
            kv_cache_memory="16MiB",
            **engine_args,
        ) as engine:
            executor = engine.cores[0].executor
            real_execute, real_sample = executor.execute_model, executor.sample_tokens

            async def execute(sched):
                scheduled.append(list(sched.num_scheduled_tokens))
                return await real_execute(sched)

            async def sample(req):  # what _grammar_bitmask sent
                for name in scheduled[-1]:
                    seen[name].append(req is not None and name in req.bitmask)
                return await real_sample(req)

            executor.execute_model, executor.sample_tokens = execute, sample
            results = {}

            async def one(name, prompt, params):
                async with engine.generate({"prompt_token_ids": prompt}, params, name) as outputs:
                    async for out in outputs:
                        results[name] = out.outputs[0]

            async with trio.open_nursery() as nursery:
                for name, (prompt, params) in requests.items():
                    nursery.start_soon(one, name, prompt, params)
            return results

    return trio.run(main), seen


def test_engine_constrains_only_after_the_reasoning(think_model):
    path, tok, start, end = think_model
    script = [start, *ids(tok, THINKING), end, *ids(tok, ANSWER)]
    mk = lambda so: SamplingParams(max_tokens=40, structured_outputs=so)  # noqa: E731
    q = ids(tok, "q")
    out, seen = run_engine(
        path,
        script,
        {
            "json": (q, mk(SO(json=CITY))),  # no tag in the prompt: <think> allowed first
            "choice": ([*q, start], mk(SO(choice=["no"]))),  # the prompt opened reasoning
            "closed": ([*q, start, end], mk(SO(choice=["no"]))),  # ... and closed it
            "plain": (q, SamplingParams(max_tokens=len(script) + 3)),
        },
        reasoning_parser="qwen3",
    )
    # The whole script, reasoning unconstrained, the JSON after it allowed; EOS ends it.
    assert out["json"].token_ids[:-1] == script and out["json"].finish_reason == "stop"
    jsonschema.validate(json.loads(out["json"].text.split(THINKING)[-1]), CITY)
    # After </think> the script's JSON is outside ["no"]: the constraint replaced it.
    think = len(ids(tok, THINKING)) + 2  # <think> ... </think>
    assert out["choice"].token_ids[:think] == script[:think]
    assert tok.decode(out["choice"].token_ids[think:-1]) == "no"
    assert out["choice"].finish_reason == "stop"
    # A prompt that ended reasoning: constrained from the first token.
    assert out["closed"].text == "no" and out["closed"].finish_reason == "stop"
    assert out["plain"].token_ids[: len(script)] == script
    # What _grammar_bitmask sent: no row while reasoning, rows from the step after </think>
    # ("json": an undecided first row, which allowed <think>).
    assert seen["json"][: think + 1] == [True] + [False] * (think - 1) + [True]
    assert seen["choice"][: think + 1] == [False] * think + [True]
    assert seen["closed"][0] and not any(seen["plain"])


def test_real_model_first_token_unconstrained_then_grammar(think_model):
    path, tok, start, end = think_model
    regex = r"[0-9]{3}-[a-z]{2}"
    # The bias (applied after the mask) picks </think> while nothing constrains it; then
    # the grammar's mask excludes it.
    params = SamplingParams(
        max_tokens=30, temperature=0, logit_bias={end: 100.0}, structured_outputs=SO(regex=regex)
    )

    async def main():
        async with open_engine(
            path,
            distributed_executor_backend="uni",
            max_model_len=256,
            kv_cache_memory="16MiB",
            reasoning_parser="deepseek_r1",
        ) as engine:
            got = []
            for prompt in ([*ids(tok, "q"), start], [*ids(tok, "q"), start, end]):
                async with engine.generate({"prompt_token_ids": prompt}, params) as outputs:
                    async for out in outputs:
                        pass
                got.append(out.outputs[0])
            return got

    open_, closed = trio.run(main)
    assert open_.token_ids[0] == end and end not in open_.token_ids[1:]
    assert re.fullmatch(regex, tok.decode(open_.token_ids[1:], skip_special_tokens=True))
    assert open_.finish_reason == closed.finish_reason == "stop"
    assert end not in closed.token_ids and re.fullmatch(regex, closed.text)


def test_llm_engine_argument_and_refusal(think_model, tiny_model_factory):
    from trillm.config import EngineArgs

    assert EngineArgs(reasoning_parser="qwen3").reasoning_parser == "qwen3"
    with pytest.raises(ValueError, match="Unknown reasoning parser 'nope'"):
        EngineArgs(reasoning_parser="nope")

    async def start(path):
        async with open_engine(
            path,
            runner=SCRIPTED,
            distributed_executor_backend="uni",
            reasoning_parser="qwen3",
            max_model_len=256,
        ):
            pass

    trio.run(start, tiny_model_factory("qwen3"))  # the shipped tokenizer: no <think>, fine
    trio.run(start, think_model[0])
    # trillm.LLM passes it to the engine: the reasoning is not constrained, then "no" is.
    path, tok, start_id, end_id = think_model
    script = [*ids(tok, "hm"), end_id, *ids(tok, "yes")]
    llm = LLM(
        path,
        runner=SCRIPTED,
        runner_kwargs={"script": script},
        reasoning_parser="deepseek_r1",
        distributed_executor_backend="uni",
        max_model_len=256,
        kv_cache_memory="16MiB",
    )
    try:
        params = SamplingParams(max_tokens=20, structured_outputs=SO(choice=["no"]))
        (out,) = llm.generate([{"prompt_token_ids": ids(tok, "q")}], params, use_tqdm=False)
        # LLM.chat splits with the engine's parser when it is given none of its own.
        (chat,) = llm.chat([{"role": "user", "content": "q"}], params, use_tqdm=False)
    finally:
        llm.shutdown()
    assert (chat.outputs[0].reasoning_content, chat.outputs[0].content) == ("hm", "no")
    n = len(ids(tok, "hm")) + 1
    assert out.outputs[0].token_ids[:n] == script[:n]
    assert tok.decode(out.outputs[0].token_ids[n:-1]) == "no"


# ---------------------------------------------------------------- HTTP


@pytest.fixture(scope="module")
def server(think_model, tmp_path_factory):
    path, tok, start, end = think_model
    script = [start, *ids(tok, THINKING), end, *ids(tok, ANSWER)]
    with open(f"{path}/{SCRIPT_FILE}", "w") as f:
        json.dump(script, f)
    log = tmp_path_factory.mktemp("server-reasoning") / "server.log"
    srv = ServerProcess(
        [
            path,
            "--runner",
            SCRIPTED,
            "--reasoning-parser",
            "qwen3",
            "--max-model-len",
            "512",
            "--kv-cache-memory",
            "16MiB",
        ],
        log,
    ).start()
    yield srv
    assert srv.stop() == 0, srv.log()


def test_http_reasoning_content_then_schema_content(server):
    client = openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0, timeout=60)
    fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": CITY}}
    ask = [{"role": "user", "content": "Where?"}]
    r = client.chat.completions.create(
        model=None,
        messages=ask,
        response_format=fmt,  # type: ignore[arg-type]
        max_tokens=40,
    )
    msg = r.choices[0].message
    assert (msg.model_extra or {})["reasoning_content"] == THINKING
    jsonschema.validate(json.loads(msg.content or ""), CITY)
    assert r.choices[0].finish_reason == "stop"
    reasoning = content = ""
    for chunk in client.chat.completions.create(
        model=None,
        messages=ask,
        response_format=fmt,  # type: ignore[arg-type]
        max_tokens=40,
        stream=True,
    ):
        if chunk.choices:
            reasoning += (chunk.choices[0].delta.model_extra or {}).get("reasoning_content") or ""
            content += chunk.choices[0].delta.content or ""
    assert reasoning == THINKING and json.loads(content) == json.loads(ANSWER)
    # A named tool: reasoning first, then its arguments are the constrained JSON.
    tool = {"type": "function", "function": {"name": "where", "parameters": CITY}}
    r = client.chat.completions.create(
        model=None,
        messages=ask,
        max_tokens=40,
        tools=[tool],  # type: ignore[arg-type,list-item]
        tool_choice={"type": "function", "function": {"name": "where"}},
    )
    msg = r.choices[0].message
    assert (msg.model_extra or {})["reasoning_content"] == THINKING
    assert msg.tool_calls and json.loads(msg.tool_calls[0].function.arguments) == {"city": "Paris"}


def test_http_server_refuses_a_tokenizer_without_the_tags(tmp_path):
    """deepseek_r1 works on the tags' token ids (vLLM's fails each request without them);
    qwen3 matches them in the text: tests/parsers/test_reasoning_without_tag_tokens.py."""
    srv = ServerProcess(
        ["--reasoning-parser", "deepseek_r1", "--kv-cache-memory", "16MiB"],
        tmp_path / "server.log",
    )
    with pytest.raises(RuntimeError, match="Reasoning parser 'deepseek_r1' needs <think> and"):
        srv.start(timeout=120)
