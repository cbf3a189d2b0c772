"""Prefill/decode disaggregation behind one address (vLLM's disaggregated-serving example
shape): each completion or chat completion goes first to the prefill instance with
``max_tokens`` 1, whose KV connector (kv_producer) saves the prompt's KV blocks; then, as it
came, to the decode instance, whose connector (kv_consumer) loads them instead of computing
them, and the decode instance's answer (JSON or SSE stream) is the client's.

    python -m trillm.entrypoints.disagg_proxy --prefill http://127.0.0.1:8100 \\
        --decode http://127.0.0.1:8200 --port 8000

A prefill answer that is not 200 is the client's answer (the decode instance is not asked).
A body that is not a JSON object (or not sent as JSON) is a 400 in OpenAI's error shape, as
the instances answer it; neither instance is asked.

With vLLM's P2pNcclConnector, ``--prefill-kv-addr IP:PORT`` (the prefill instance's
``kv_ip:kv_port``) tells the decode instance where the prompt's KV is, and
``--decode-kv-addr IP:PORT`` (the decode instance's) tells a pushing prefill instance
(``send_type`` "PUT" / "PUT_ASYNC") where to send it, as vLLM's proxy does: both instances get
the request id
``___prefill_addr_IP:PORT___decode_addr_<--decode-kv-addr>_<uuid or the client's request_id>``.
The decode instance fetches or takes pushes only from the addresses its
``kv_connector_extra_config.prefill_kv_addrs`` lists, and a pushing prefill instance pushes
only to those its ``decode_kv_addrs`` lists (a client can set the request id): list these
addresses there.
"""

from __future__ import annotations

import argparse
import uuid
from collections.abc import AsyncIterator
from typing import Any

import httpx
import trio
from quart import Response, request
from quart_trio import QuartTrio

from trillm.entrypoints.openai.http.bodies import json_body, json_response
from trillm.entrypoints.openai.http.errors import APIError

GENERATION_ROUTES = ("/v1/completions", "/v1/chat/completions")
# Options of a request that only make sense for its answer, not for computing its prompt.
_ANSWER_ONLY = ("stream", "stream_options", "n", "best_of", "max_completion_tokens")


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """The request as the prefill instance gets it: one token, one sample, no stream."""
    kept = {k: v for k, v in body.items() if k not in _ANSWER_ONLY}
    return {**kept, "max_tokens": 1}


def with_kv_addresses(body: dict[str, Any], prefill_kv: str, decode_kv: str) -> dict[str, Any]:
    """The request under vLLM's P2P request id naming the instances' KV addresses."""
    suffix = body.get("request_id") or uuid.uuid4().hex
    return {
        **body,
        "request_id": f"___prefill_addr_{prefill_kv}___decode_addr_{decode_kv}_{suffix}",
    }


def _forwarded_headers() -> dict[str, str]:
    auth = request.headers.get("Authorization")
    return {} if auth is None else {"Authorization": auth}


def make_app(
    prefill_url: str, decode_url: str, prefill_kv: str | None = None, decode_kv: str = ""
) -> QuartTrio:
    app = QuartTrio("trillm-disagg-proxy", static_folder=None)  # no /static/<path> route
    client = httpx.AsyncClient(timeout=None)

    async def relay(path: str) -> Response:
        body = await json_body()  # an object, else a 400 / 415 APIError
        if prefill_kv is not None:
            body = with_kv_addresses(body, prefill_kv, decode_kv)
        headers = _forwarded_headers()
        first = await client.post(prefill_url + path, json=prefill_body(body), headers=headers)
        if first.status_code != 200:
            return _answer(first, first.content)
        upstream = await client.send(
            client.build_request("POST", decode_url + path, json=body, headers=headers),
            stream=True,
        )
        if not body.get("stream"):
            return _answer(upstream, await upstream.aread())

        async def chunks() -> AsyncIterator[bytes]:
            try:
                async for chunk in upstream.aiter_raw():
                    yield chunk
            finally:
                await upstream.aclose()

        return _answer(upstream, chunks())

    @app.errorhandler(APIError)
    async def api_error(err: APIError) -> Response:
        return json_response(err.body(), err.status)

    for path in GENERATION_ROUTES:
        app.add_url_rule(path, path, _bind(relay, path), methods=["POST"])

    @app.route("/v1/models")
    async def models() -> Response:
        answer = await client.get(decode_url + "/v1/models", headers=_forwarded_headers())
        return _answer(answer, answer.content)

    @app.route("/health")
    async def health() -> Response:
        return Response("", status=200)

    return app


def _bind(relay: Any, path: str) -> Any:
    async def route() -> Response:
        return await relay(path)

    return route


def _answer(upstream: httpx.Response, content: Any) -> Response:
    kind = upstream.headers.get("content-type", "application/json")
    return Response(content, status=upstream.status_code, content_type=kind)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prefill", required=True, help="the kv_producer instance's base URL")
    parser.add_argument("--decode", required=True, help="the kv_consumer instance's base URL")
    parser.add_argument(
        "--prefill-kv-addr",
        help="P2pNcclConnector: the prefill instance's kv_ip:kv_port, named in each request id "
        "(list it in the decode instance's kv_connector_extra_config.prefill_kv_addrs)",
    )
    parser.add_argument(
        "--decode-kv-addr",
        default="",
        help="P2pNcclConnector: the decode instance's kv_ip:kv_port, named in each request id "
        "(send_type PUT / PUT_ASYNC: list it in the prefill instance's "
        "kv_connector_extra_config.decode_kv_addrs)",
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    args = parser.parse_args(argv)
    app = make_app(
        args.prefill.rstrip("/"), args.decode.rstrip("/"), args.prefill_kv_addr, args.decode_kv_addr
    )
    trio.run(serve, app, args.host, args.port)


async def serve(app: QuartTrio, host: str, port: int) -> None:
    from hypercorn.config import Config

    from trillm.entrypoints.openai.http.listener import hypercorn_serve

    config = Config()
    config.bind = [f"{host}:{port}"]
    await hypercorn_serve(app, config)


if __name__ == "__main__":
    main()
