"""Incremental detokenization: deltas add up to the text, word-start markers and partial UTF-8."""

from __future__ import annotations

import json

import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from lorafleet.worker.tokenizer import IncrementalDetokenizer, Tokenizer

CORPUS = ["the router sends each request to a worker", "hello world, the adapters answer", "héllo wörld ünïcode"]


@pytest.fixture
def metaspace_tokenizer(tmp_path) -> Tokenizer:
    """A SentencePiece-style tokenizer: "▁" marks a word start, as in Llama 2 and Mistral."""
    tok = HFTokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    tok.train_from_iterator(CORPUS * 3, trainers.BpeTrainer(vocab_size=120, special_tokens=["<unk>", "<s>", "</s>"],
                                                          show_progress=False))
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    return Tokenizer(tmp_path)


def stream(detok: IncrementalDetokenizer, ids: list[int]) -> str:
    return "".join(detok.update(ids[: i + 1]) for i in range(len(ids)))


def test_word_start_marker_keeps_the_leading_space(metaspace_tokenizer):
    ids = metaspace_tokenizer.encode("the router sends each request", add_special_tokens=False)
    prompt, output = ids[:3], ids[3:]
    whole = metaspace_tokenizer.decode(ids)
    text = stream(IncrementalDetokenizer(metaspace_tokenizer, prompt), output)
    assert metaspace_tokenizer.decode(prompt) + text == whole
    assert text.startswith(" ")  # decoding the output alone would lose it
    assert not metaspace_tokenizer.decode(output).startswith(" ")


def test_partial_utf8_is_held_back_then_flushed(demo_model):
    tok = Tokenizer(demo_model)
    ids = tok.encode("héllo wörld", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, [])
    deltas = [detok.update(ids[: i + 1]) for i in range(len(ids))]
    assert "".join(deltas) == "héllo wörld"
    assert all("\ufffd" not in d for d in deltas)
    cut = IncrementalDetokenizer(tok, [])
    byte_tokens = tok.encode("é", add_special_tokens=False)
    if len(byte_tokens) > 1:  # a character split over byte tokens: nothing until it completes
        assert cut.update(byte_tokens[:1]) == ""
        assert cut.finish(byte_tokens[:1]) == "\ufffd"


@pytest.mark.parametrize("which", ["metaspace", "byte_level"])
def test_streamed_text_equals_one_decode_over_long_outputs(which, metaspace_tokenizer, demo_model):
    """Random token streams (byte pieces, spaces, unicode): the deltas, then finish, add up to a
    single decode of the whole output — the windowed decode loses nothing over 300 tokens."""
    import random

    tok = metaspace_tokenizer if which == "metaspace" else Tokenizer(demo_model)
    vocab = tok.encode(" ".join(CORPUS) + " ünïcode ☃ 語", add_special_tokens=False)
    rng = random.Random(7)
    for _ in range(5):
        prompt = [rng.choice(vocab) for _ in range(6)]
        output = [rng.choice(vocab) for _ in range(300)]
        detok = IncrementalDetokenizer(tok, prompt)
        streamed = stream(detok, output)
        final = detok.finish(output)
        assert final.startswith(streamed) and final == detok.text
        assert tok.decode(prompt) + final == tok.decode(prompt + output)
