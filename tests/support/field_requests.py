"""Requests for the field-effect tests: a body for either endpoint, posted, its first choice in
one shape for both, a refusal checked to name the field, a stream's events and their text."""

from __future__ import annotations

import json

import httpx
from server_harness import ServerProcess

PROMPT = "And God said, Let there be light"
EOS = 2  # <|im_end|>: the embedded model's EOS token
IM_START = 1  # another special token
ENDPOINTS = ["completions", "chat"]


def body(endpoint: str, **fields) -> dict:
    base = {"max_tokens": 8, "temperature": 0, "return_token_ids": True}
    if endpoint == "completions":
        base["prompt"] = PROMPT
    else:
        base["messages"] = [{"role": "user", "content": PROMPT}]
    return {**base, **fields}


def post(srv: ServerProcess, endpoint: str, payload: dict) -> httpx.Response:
    path = "/v1/completions" if endpoint == "completions" else "/v1/chat/completions"
    return httpx.post(srv.url + path, json=payload, timeout=120)


def full(srv: ServerProcess, endpoint: str, **fields) -> dict:
    r = post(srv, endpoint, body(endpoint, **fields))
    assert r.status_code == 200, r.text
    return r.json()


def gen(srv: ServerProcess, endpoint: str, **fields) -> dict:
    """The first choice as {text, ids, finish, raw}, the same shape for both endpoints."""
    out = full(srv, endpoint, **fields)
    choice = out["choices"][0]
    text = choice["text"] if endpoint == "completions" else choice["message"]["content"]
    return {
        "text": text,
        "ids": choice.get("token_ids"),
        "finish": choice["finish_reason"],
        "choice": choice,
        "raw": out,
    }


def refused(srv: ServerProcess, endpoint: str, param: str, **fields) -> str:
    r = post(srv, endpoint, body(endpoint, **fields))
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert param in (error["param"] or "") or param in error["message"], error
    return error["message"]


def stream_events(srv: ServerProcess, endpoint: str, **fields) -> list[dict]:
    path = "/v1/completions" if endpoint == "completions" else "/v1/chat/completions"
    payload = body(endpoint, stream=True, **fields)
    events = []
    with httpx.stream("POST", srv.url + path, json=payload, timeout=120) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: {"):
                events.append(json.loads(line[6:]))
    return events


def chunk_text(endpoint: str, event: dict) -> str:
    if not event["choices"]:
        return ""
    choice = event["choices"][0]
    if endpoint == "completions":
        return choice.get("text") or ""
    return choice.get("delta", {}).get("content") or ""
