"""Chat ``image_url`` parts over HTTP with the official openai client: a data: URL image is
greedy-exact vs transformers on the tiny LLaVA (the prompt the chat template renders, with
the image part as ``<image>``), and every bad image part is a 400 naming it while the server
keeps serving."""

from __future__ import annotations

import os
import threading
import time

import httpx
import openai
import pytest
from image_server import ImageServer
from llava_reference import chat_text, data_url, hf_llava_greedy, image, png, png_claiming
from server_harness import ServerProcess

NAME = "tiny-llava"
MAX_NEW = 8
FETCH_TIMEOUT = 2  # VLLM_IMAGE_FETCH_TIMEOUT of the server


@pytest.fixture(scope="module")
def llava_path(tmp_path_factory):
    from trillm.testing.tiny_llava import build_tiny_llava

    return str(build_tiny_llava(tmp_path_factory.mktemp("tiny-llava-http")))


@pytest.fixture(scope="module")
def media(tmp_path_factory):
    """(the local image server, the --allowed-local-media-path directory, a directory
    outside it); the directory holds image.png and a symlink to it, plus symlinks leading
    out of it."""
    root = tmp_path_factory.mktemp("media")
    outside = tmp_path_factory.mktemp("outside")
    (root / "image.png").write_bytes(png(image(11)))
    (root / "sub").mkdir()
    (root / "sub" / "link.png").symlink_to(root / "image.png")
    (outside / "secret.png").write_bytes(png(image(11)))
    (root / "escape.png").symlink_to(outside / "secret.png")
    with ImageServer(png(image(11))) as server:
        yield server, root, outside


@pytest.fixture(scope="module")
def server(llava_path, media, tmp_path_factory):
    log = tmp_path_factory.mktemp("server-llava") / "server.log"
    args = [llava_path, "--served-model-name", NAME, "--max-model-len", "256"]
    args += [
        "--kv-cache-memory",
        "8MiB",
        "--max-num-seqs",
        "4",
        "--distributed-executor-backend",
        "uni",
        "--allowed-local-media-path",
        str(media[1]),
        "--allowed-media-domains",
        "127.0.0.1",
    ]
    os.environ["VLLM_IMAGE_FETCH_TIMEOUT"] = str(FETCH_TIMEOUT)
    try:
        srv = ServerProcess(args, log).start()
    finally:
        del os.environ["VLLM_IMAGE_FETCH_TIMEOUT"]
    yield srv
    assert srv.stop() == 0, srv.log()


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(
        base_url=server.base_url, api_key="unused", max_retries=0, timeout=120
    ) as client:
        yield client


def chat(client, parts, max_tokens=MAX_NEW, extra_body=None, **kwargs):
    return client.chat.completions.create(
        model=NAME,
        messages=[{"role": "user", "content": parts}],
        max_tokens=max_tokens,
        temperature=0.0,
        extra_body={"return_token_ids": True, "ignore_eos": True, **(extra_body or {})},
        **kwargs,
    )


def test_data_url_image_is_greedy_exact(client, llava_path):
    from transformers import AutoTokenizer

    img = image(11)
    parts = [
        {"type": "image_url", "image_url": {"url": data_url(png(img))}},
        {"type": "text", "text": "What is this?"},
    ]
    out = chat(client, parts)
    tok = AutoTokenizer.from_pretrained(llava_path)
    text = tok.apply_chat_template(
        [{"role": "user", "content": "<image>\nWhat is this?"}],
        tokenize=False,
        add_generation_prompt=True,
    )
    ids, tokens = hf_llava_greedy(llava_path, text, [img], MAX_NEW)
    assert out.model_extra["prompt_token_ids"] == ids
    assert out.choices[0].model_extra["token_ids"] == tokens
    assert out.usage.prompt_tokens == len(ids)  # the placeholders counted


def test_bad_image_parts_are_400_naming_them(client):
    good = png(image(12))
    cases = [
        ("https://example.com/cat.png", "'example.com' is not one of --allowed-media-domains"),
        ("file:///etc/hostname", "is not inside --allowed-local-media-path"),
        ("data:image/png;base64,%%%not-base64", "not valid base64"),
        (data_url(good, "text/plain"), "is not an image"),
        (data_url(b"\x00garbage bytes"), "cannot be read as an image"),
        (data_url(good[:200]), "cannot be decoded"),  # a PNG header, then too little data
        (data_url(png_claiming(4200, 4200)), "more than the limit of 16777216"),
        (data_url(png_claiming(50_000, 50_000)), "more pixels than the limit"),  # PIL's bomb
    ]
    for url, words in cases:
        with pytest.raises(openai.BadRequestError) as info:
            chat(client, [{"type": "image_url", "image_url": {"url": url}}])
        assert words in str(info.value), (url[:40], str(info.value))
    two = [{"type": "image_url", "image_url": {"url": data_url(good)}}] * 2
    with pytest.raises(openai.BadRequestError, match="at most 1 per prompt"):
        chat(client, two)
    out = chat(client, [{"type": "text", "text": "still serving"}])
    assert len(out.choices[0].model_extra["token_ids"]) == MAX_NEW


def image_part(url):
    return {"type": "image_url", "image_url": {"url": url}}


def test_file_and_http_urls_answer_as_the_data_url_does(client, media):
    srv, root, _ = media
    text = {"type": "text", "text": "What is this?"}
    answers = [
        chat(client, [image_part(url), text]).choices[0].model_extra["token_ids"]
        for url in [
            data_url(png(image(11))),
            (root / "image.png").as_uri(),
            (root / "sub" / "link.png").as_uri(),  # a symlink that stays inside
            srv.url("/img.png"),
            srv.url("/redirect/3"),  # redirects followed, each hop's host checked
        ]
    ]
    assert all(a == answers[0] for a in answers), answers


def test_bad_urls_are_400_within_the_limit_while_a_stream_runs(client, media):
    srv, root, outside = media
    cases = [
        ((outside / "secret.png").as_uri(), "is not inside --allowed-local-media-path"),
        ((root / "escape.png").as_uri(), "is not inside --allowed-local-media-path"),  # symlink
        ((root / "sub").as_uri(), "is not a regular file"),
        ((root / "nothing.png").as_uri(), "does not exist"),
        (srv.url("/claims-big"), "brings more than 33554432 bytes"),
        (srv.url("/streams-big"), "brings more than 33554432 bytes"),
        (srv.url("/text"), "has content type 'text/html', not an image"),
        (srv.url("/missing"), "answered HTTP 404"),
        (srv.url("/redirect/9"), "redirects more than 5 times"),
        (srv.url("/elsewhere"), "'localhost' is not one of --allowed-media-domains"),
        (srv.url("/img.png", host="localhost"), "'localhost' is not one of"),
    ]
    for url, words in cases:
        with pytest.raises(openai.BadRequestError) as info:
            chat(client, [image_part(url)])
        assert words in str(info.value), (url, str(info.value))
    # A fetch that hangs is a 400 at the time limit; a stream started meanwhile runs to its
    # end unharmed (the same tokens as alone) before it.
    prompt = [{"type": "text", "text": "Count on"}]
    alone = chat(client, prompt, max_tokens=64).choices[0].model_extra["token_ids"]
    hang: dict = {}

    def fetch_hanging():
        start = time.monotonic()
        try:
            chat(client, [image_part(srv.url("/hang"))])
        except openai.BadRequestError as exc:
            hang["error"] = str(exc)
        hang["seconds"] = time.monotonic() - start

    thread = threading.Thread(target=fetch_hanging)
    thread.start()
    time.sleep(0.2)
    stream = client.chat.completions.create(
        model=NAME,
        messages=[{"role": "user", "content": prompt}],
        max_tokens=64,
        temperature=0.0,
        stream=True,
        extra_body={"return_token_ids": True, "ignore_eos": True},
    )
    tokens = [
        t for chunk in stream for c in chunk.choices for t in c.model_extra.get("token_ids") or []
    ]
    assert "seconds" not in hang  # the stream ended while the fetch still hung
    thread.join()
    assert tokens == alone
    assert f"took longer than {FETCH_TIMEOUT} s (VLLM_IMAGE_FETCH_TIMEOUT)" in hang["error"]
    assert FETCH_TIMEOUT <= hang["seconds"] < FETCH_TIMEOUT + 1.5, hang


def test_tokenize_gives_the_expanded_prompt(client, server):
    parts = [image_part(data_url(png(image(11)))), {"type": "text", "text": "What is this?"}]
    expected = chat(client, parts).model_extra["prompt_token_ids"]
    body = {"model": NAME, "messages": [{"role": "user", "content": parts}]}
    got = httpx.post(f"{server.url}/tokenize", json=body, timeout=60).json()
    assert got["tokens"] == expected and got["count"] == len(expected)
    assert expected.count(4096) == 16  # the placeholders counted
    bad = {**body, "mm_processor_kwargs": {"bogus": 1}}
    answer = httpx.post(f"{server.url}/tokenize", json=bad, timeout=60)
    assert answer.status_code == 400 and "'bogus' not taken" in answer.text


def test_mm_processor_kwargs_per_request(client, llava_path):
    img = image(14)
    parts = [image_part(data_url(png(img))), {"type": "text", "text": "What is this?"}]
    kwargs = {"do_normalize": False}
    out = chat(client, parts, extra_body={"mm_processor_kwargs": kwargs})
    text = chat_text(llava_path, "<image>\nWhat is this?")
    reference = hf_llava_greedy(llava_path, text, [img], MAX_NEW, **kwargs)
    assert out.choices[0].model_extra["token_ids"] == reference[1]
    for kwargs, words in [
        ({"bogus": 1}, "mm_processor_kwargs: 'bogus' not taken by this model's image processor"),
        (
            {"size": {"shortest_edge": 64}, "crop_size": {"height": 64, "width": 64}},
            r"whole numbers in \[1, 32\]",
        ),
    ]:
        with pytest.raises(openai.BadRequestError, match=words):
            chat(client, parts, extra_body={"mm_processor_kwargs": kwargs})
    with pytest.raises(openai.BadRequestError, match="'bogus' not taken"):  # no image either
        chat(
            client,
            [{"type": "text", "text": "hi"}],
            extra_body={"mm_processor_kwargs": {"bogus": 1}},
        )
