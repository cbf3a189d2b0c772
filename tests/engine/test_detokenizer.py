"""Incremental detokenization: both twins against ``tokenizer.decode`` on real tokenizers.

Property: for random token sequences fed in random chunks, whenever the detokenizer reports
no pending bytes the emitted text equals ``decode(ids so far)``; the emitted text is always a
prefix of the final decode; after ``flush`` it equals ``decode(all ids)``.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from trillm.engine.detokenizer import (
    DetokenizerFactory,
    PyIncrementalDetokenizer,
    PyVocab,
    load_native_module,
)
from trillm.engine.vocab_spec import DecoderScheme, build_vocab_spec
from trillm.testing.tiny_models import DEFAULT_MODEL_DIR

NATIVE = load_native_module()
IMPLS = [
    "python",
    pytest.param(
        "native",
        marks=pytest.mark.skipif(NATIVE is None, reason="trillm._ext.detokenizer not built"),
    ),
]
PROPERTY = settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


# ---------------------------------------------------------------- tokenizers under test


@pytest.fixture(scope="module")
def hf_tokenizer():
    return AutoTokenizer.from_pretrained(str(DEFAULT_MODEL_DIR))


def build_sentencepiece_style(decoder: str = "llama") -> Tokenizer:
    """A Llama-style tokenizer: BPE with byte fallback, Metaspace, Replace+ByteFallback+Fuse+Strip."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    pieces = [
        "▁",
        "▁▁",
        "▁hello",
        "hello",
        "▁world",
        "a",
        "b",
        "x▁y",
        "你",
        "▁你好",
        "世界",
        "🙂",
        "▁🚀",
        "é",
        "▁naïve",
        ".",
    ]
    for piece in pieces:
        vocab[piece] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], byte_fallback=True, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    if decoder == "llama":
        tok.decoder = decoders.Sequence(
            [
                decoders.Replace("▁", " "),
                decoders.ByteFallback(),
                decoders.Fuse(),
                decoders.Strip(" ", 1, 0),
            ]
        )
    else:
        tok.decoder = decoders.Metaspace()
    tok.add_special_tokens(["<s>", "</s>", AddedToken("<▁tool>", special=True)])
    tok.add_tokens([AddedToken("<plain>", special=False)])
    return tok


@pytest.fixture(scope="module")
def sp_tokenizer():
    return build_sentencepiece_style("llama")


@pytest.fixture(scope="module")
def ms_tokenizer():
    return build_sentencepiece_style("metaspace")


_SPECS: dict[int, object] = {}
_FACTORIES: dict[tuple[int, str], DetokenizerFactory] = {}


def spec_of(tok):
    if id(tok) not in _SPECS:
        _SPECS[id(tok)] = (tok, build_vocab_spec(tok))  # keeps tok alive: ids stay unique
    return _SPECS[id(tok)][1]


def interesting_ids(tok) -> list[int]:
    """Byte-ish tokens (lone continuation bytes, lead bytes, invalid bytes), specials, CJK."""
    spec = spec_of(tok)
    assert spec is not None
    ids = [i for i, b in enumerate(spec.table) if len(b) == 1 and b[0] >= 0x80]
    ids += spec.special_ids + spec.byte_token_ids[0x20:0x42:0x21]  # <0x20>, <0x41>
    text = "你好，世界。日本語のテキスト 🙂🚀 naïve café."
    ids += tok.encode(text).ids if isinstance(tok, Tokenizer) else tok.encode(text)
    return sorted(set(ids))


def id_lists(tok) -> st.SearchStrategy[list[int]]:
    spec = spec_of(tok)
    picked = st.sampled_from(interesting_ids(tok))
    anything = st.integers(0, len(spec.table) - 1)
    return st.lists(st.one_of(picked, picked, anything), min_size=0, max_size=24)


def new_detok(tok, impl: str, skip: bool, prompt: list[int] | None = None):
    key = (id(tok), impl)
    if key not in _FACTORIES:
        spec_of(tok)  # pins tok so id(tok) is not reused
        _FACTORIES[key] = DetokenizerFactory(tok, native=impl == "native")
    factory = _FACTORIES[key]
    assert factory.kind == impl
    return factory.new(skip, prompt or [])


def check_incremental(tok, impl, ids, chunks, skip, prompt=None):
    """Feeds ids in chunks; checks finality at each boundary and equality after flush."""
    prompt = prompt or []
    prompt_text = new_detok(tok, impl, skip).add_tokens(prompt) if prompt else ""
    detok = new_detok(tok, impl, skip, prompt)
    final = tok.decode(prompt + ids, skip_special_tokens=skip)
    emitted, pos = prompt_text, 0
    for size in chunks:
        if pos >= len(ids):
            break
        emitted += detok.add_tokens(ids[pos : pos + size])
        pos += size
        assert final.startswith(emitted)
        if not detok.has_pending:
            assert emitted == tok.decode(prompt + ids[:pos], skip_special_tokens=skip)
    emitted += detok.add_tokens(ids[pos:])
    emitted += detok.flush()
    assert emitted == final
    assert not detok.has_pending


# ---------------------------------------------------------------- properties


@pytest.mark.parametrize("impl", IMPLS)
@PROPERTY
@given(data=st.data(), skip=st.booleans())
def test_byte_level_matches_decode(hf_tokenizer, impl, data, skip):
    ids = data.draw(id_lists(hf_tokenizer), label="ids")
    chunks = data.draw(st.lists(st.integers(1, 5), max_size=24), label="chunks")
    check_incremental(hf_tokenizer, impl, ids, chunks, skip)


@pytest.mark.parametrize("impl", IMPLS)
@PROPERTY
@given(data=st.data(), skip=st.booleans())
def test_sentencepiece_style_matches_decode(sp_tokenizer, impl, data, skip):
    ids = data.draw(id_lists(sp_tokenizer), label="ids")
    chunks = data.draw(st.lists(st.integers(1, 5), max_size=24), label="chunks")
    check_incremental(sp_tokenizer, impl, ids, chunks, skip)


@pytest.mark.parametrize("impl", IMPLS)
@PROPERTY
@given(data=st.data(), skip=st.booleans())
def test_prompt_context(hf_tokenizer, sp_tokenizer, ms_tokenizer, impl, data, skip):
    """prompt text (emitted while priming) + output text == decode(prompt + output)."""
    tok = data.draw(st.sampled_from([hf_tokenizer, sp_tokenizer, ms_tokenizer]), label="tokenizer")
    prompt = data.draw(id_lists(tok), label="prompt")
    ids = data.draw(id_lists(tok), label="ids")
    chunks = data.draw(st.lists(st.integers(1, 5), max_size=24), label="chunks")
    check_incremental(tok, impl, ids, chunks, skip, prompt)


@pytest.mark.skipif(NATIVE is None, reason="trillm._ext.detokenizer not built")
@PROPERTY
@given(data=st.data(), skip=st.booleans())
def test_twins_agree_chunk_by_chunk(hf_tokenizer, sp_tokenizer, ms_tokenizer, data, skip):
    tok = data.draw(st.sampled_from([hf_tokenizer, sp_tokenizer, ms_tokenizer]), label="tokenizer")
    ids = data.draw(id_lists(tok), label="ids")
    chunks = data.draw(st.lists(st.integers(1, 5), min_size=1, max_size=12), label="chunks")
    native, python = new_detok(tok, "native", skip), new_detok(tok, "python", skip)
    pos = 0
    for size in chunks:
        piece = ids[pos : pos + size]
        pos += size
        assert native.add_tokens(piece) == python.add_tokens(piece)
        assert native.has_pending == python.has_pending
    assert native.flush() == python.flush()


# ---------------------------------------------------------------- pinned cases


@pytest.mark.parametrize("impl", IMPLS)
def test_split_emoji_is_held_then_emitted(hf_tokenizer, impl):
    ids = hf_tokenizer.encode(" 🙂")
    assert len(ids) > 1 and "\ufffd" in hf_tokenizer.decode(ids[:1])
    detok = new_detok(hf_tokenizer, impl, True)
    assert detok.add_tokens(ids[:1]) == " "  # the space is final, the emoji's bytes are not
    assert detok.has_pending
    assert detok.add_tokens(ids[1:]) == "🙂"
    assert not detok.has_pending


@pytest.mark.parametrize("impl", IMPLS)
def test_flush_replaces_incomplete_character(hf_tokenizer, impl):
    ids = hf_tokenizer.encode(" 🙂")[:1]
    detok = new_detok(hf_tokenizer, impl, True)
    assert detok.add_tokens(ids) == " "
    assert detok.flush() == "\ufffd"
    assert hf_tokenizer.decode(ids) == " \ufffd"


@pytest.mark.parametrize("impl", IMPLS)
def test_byte_fallback_invalid_run_is_one_replacement_per_byte(sp_tokenizer, impl):
    byte = lambda b: sp_tokenizer.token_to_id(f"<0x{b:02X}>")  # noqa: E731
    ids = [byte(0xE4), byte(0xBD), byte(0xA0), byte(0xFF), sp_tokenizer.token_to_id("a")]
    detok = new_detok(sp_tokenizer, impl, True)
    assert detok.add_tokens(ids[:3]) == ""  # "你" so far, but the run may still turn invalid
    assert detok.add_tokens(ids[3:4]) == "\ufffd" * 4
    assert detok.add_tokens(ids[4:]) == "a"
    assert sp_tokenizer.decode(ids) == "\ufffd" * 4 + "a"


@pytest.mark.parametrize("impl", IMPLS)
def test_sentencepiece_leading_space(sp_tokenizer, impl):
    hello, world = sp_tokenizer.token_to_id("▁hello"), sp_tokenizer.token_to_id("▁world")
    fresh = new_detok(sp_tokenizer, impl, True)
    assert fresh.add_tokens([hello, world]) == "hello world"
    after_prompt = new_detok(sp_tokenizer, impl, True, prompt=[hello])
    assert after_prompt.add_tokens([world]) == " world"


@pytest.mark.parametrize("impl", IMPLS)
def test_ids_past_the_tokenizer_have_no_text(hf_tokenizer, impl):
    # A model's padded vocabulary can sample ids the tokenizer does not have: they decode to
    # nothing, as in tokenizer.decode, and never fail the request.
    ids = hf_tokenizer.encode("Hello world")
    detok = new_detok(hf_tokenizer, impl, True)
    text = detok.add_tokens([ids[0], 10**6, *ids[1:], 10**6 + 1]) + detok.flush()
    assert text == hf_tokenizer.decode([ids[0], 10**6, *ids[1:]]) == hf_tokenizer.decode(ids)
    with pytest.raises(IndexError):
        detok.add_tokens([-1])


@pytest.mark.parametrize("impl", IMPLS)
def test_metaspace_decoder_is_modelled(impl):
    """Metaspace drops every '▁' of the first kept token and turns the others into spaces."""
    tok = build_sentencepiece_style("metaspace")
    spec = spec_of(tok)
    assert spec is not None and spec.scheme == DecoderScheme.BYTE_FALLBACK
    assert spec.byte_token_ids == [] and spec.first_table
    ids = [tok.token_to_id(p) for p in ["x▁y", "▁hello", "<0x41>", "▁▁", "你"]]
    assert tok.decode(ids) == "xy hello<0x41>  你"
    for skip in (True, False):
        check_incremental(tok, impl, ids, [1, 2, 1, 1], skip)
        check_incremental(tok, impl, [tok.token_to_id("<▁tool>"), *ids], [1, 2, 1], skip)


def test_transformers_wrapper_decodes_like_backend(sp_tokenizer):
    wrapped = PreTrainedTokenizerFast(tokenizer_object=sp_tokenizer)
    ids = [sp_tokenizer.token_to_id(p) for p in ["▁hello", "<0xE4>", "<0xBD>", "<0xA0>", "."]]
    assert wrapped.decode(ids) == sp_tokenizer.decode(ids, skip_special_tokens=False)
    check_incremental(wrapped, "python", ids, [2, 1, 2], False)


def test_unmodelled_decoder_falls_back_to_decode_stream():
    tok = build_sentencepiece_style("llama")
    tok.decoder = decoders.WordPiece()
    factory = DetokenizerFactory(tok, native=False)
    assert factory.kind == "stream"
    ids = [tok.token_to_id(p) for p in ["hello", "a", "b", "."]]
    detok = factory.new(True)
    text = "".join(detok.add_tokens([i]) for i in ids) + detok.flush()
    assert text == tok.decode(ids)


def test_env_switch_forces_python(hf_tokenizer, monkeypatch):
    monkeypatch.setenv("TRILLM_NO_EXTENSIONS", "1")
    assert DetokenizerFactory(hf_tokenizer).kind == "python"


def test_python_twin_holds_an_incomplete_character():
    detok = PyIncrementalDetokenizer(PyVocab([b"a", b"\xc3", b"\xa9"], [0]), True)
    assert detok.add_tokens([0, 1]) == ""
    assert detok.add_tokens([2]) == "é"


def vocab_class(impl: str):
    return NATIVE.Vocab if impl == "native" else PyVocab


@pytest.mark.parametrize("impl", IMPLS)
def test_vocab_validates_its_arguments(impl):
    vocab = vocab_class(impl)
    with pytest.raises(IndexError):
        vocab([b"a"], [1])
    with pytest.raises(ValueError, match="exactly one byte"):
        vocab([b"ab"], [], 1, [0], 0)


@pytest.mark.skipif(NATIVE is None, reason="trillm._ext.detokenizer not built")
@pytest.mark.parametrize("impl", ["native", "python"])
@pytest.mark.parametrize("follow", [[], [0x80], [0x41]])
def test_a_surrogate_lead_is_final_at_once(hf_tokenizer, sp_tokenizer, impl, follow):
    """ED A1 (a UTF-16 surrogate's lead) can never become valid: both twins emit two U+FFFD
    at once (CPython's incremental decoder alone would wait for a third byte), byte-level and
    byte-fallback alike, and the whole text still equals the tokenizer's decode."""
    byte_level = {
        b: hf_tokenizer.convert_tokens_to_ids(c)
        for b, c in ((0xED, "í"), (0xA1, "¡"), (0x80, "Ā"), (0x41, "A"))
    }
    fallback = {b: sp_tokenizer.token_to_id(f"<0x{b:02X}>") for b in (0xED, 0xA1, 0x80, 0x41)}
    for tok, ids in ((hf_tokenizer, byte_level), (sp_tokenizer, fallback)):
        detok = new_detok(tok, impl, False)
        assert detok.add_tokens([ids[0xED], ids[0xA1]]) == "\ufffd\ufffd"
        rest = detok.add_tokens([ids[b] for b in follow]) + detok.flush()
        whole = [ids[0xED], ids[0xA1], *(ids[b] for b in follow)]
        assert "\ufffd\ufffd" + rest == tok.decode(whole), (tok, follow)
