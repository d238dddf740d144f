"""Incremental detokenization: deltas add up to the text, word-start markers and partial UTF-8."""

from __future__ import annotations

import json

import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from lorafleet.worker.engine.tokenizer import IncrementalDetokenizer, Tokenizer

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


def test_partial_utf8_is_held_back_and_left_out_at_the_end(demo_model):
    tok = Tokenizer(demo_model)
    ids = tok.encode("héllo wörld", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, [])
    deltas = [detok.update(ids[: i + 1]) for i in range(len(ids))]
    assert "".join(deltas) == "héllo wörld"
    assert all("\ufffd" not in d for d in deltas)
    cut = IncrementalDetokenizer(tok, [])
    byte_tokens = tok.encode("é", add_special_tokens=False)
    assert len(byte_tokens) > 1  # a character split over byte tokens: nothing until it completes
    assert cut.update(byte_tokens[:1]) == ""
    # cut there (max_tokens): the partial character is left out, as vLLM's DecodeStream does
    assert cut.finish(byte_tokens[:1]) == ""
    head = tok.encode("caf", add_special_tokens=False)
    assert IncrementalDetokenizer(tok, []).finish(head + byte_tokens[:1]) == "caf"


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
        whole = tok.decode(prompt + output)
        # a partial character at the very end is left out (vLLM's rule; the DecodeStream test below)
        assert tok.decode(prompt) + final == (whole.rstrip("\ufffd") if whole.endswith("\ufffd") else whole)


@pytest.mark.parametrize("which", ["metaspace", "byte_level"])
def test_final_text_is_tokenizers_decode_stream_text(which, metaspace_tokenizer, demo_model):
    """vLLM's detokenizer for fast tokenizers is tokenizers' DecodeStream, primed with the prompt:
    its text is the sum of the steps' chunks, a partial character at the end never emitted. Ours
    equals it, for outputs cut inside characters (random byte tokens, max_tokens at every length)."""
    import random

    from tokenizers.decoders import DecodeStream

    tok = metaspace_tokenizer if which == "metaspace" else Tokenizer(demo_model)
    vocab = tok.encode(" ".join(CORPUS) + " ünïcode ☃ 語 é", add_special_tokens=False)
    split = [t for t in vocab if tok.decode([t]) == "\ufffd"]  # tokens holding part of a character
    assert which == "metaspace" or split
    rng = random.Random(11)
    cut_inside = 0
    for _ in range(40):
        prompt = tok.encode(" ".join(rng.sample(CORPUS, 3)), add_special_tokens=False)  # text: whole characters
        output = [rng.choice(split if split and rng.random() < 0.3 else vocab) for _ in range(rng.randint(1, 12))]
        oracle = DecodeStream(ids=prompt, skip_special_tokens=True)
        want = "".join(oracle.step(tok._tok, t) or "" for t in output)
        detok = IncrementalDetokenizer(tok, prompt)
        stream(detok, output[:-1])
        assert detok.finish(output) == want, (prompt, output)
        cut_inside += tok.decode(prompt + output).endswith("\ufffd")
    assert which == "metaspace" or cut_inside > 0  # the case this is about was met


@pytest.mark.parametrize("text", ["a\ud800b", "\udfff", "ok \ud83d"])
def test_a_lone_surrogate_is_a_value_error_that_says_where(demo_model, text):
    """JSON's "\\ud800" escape parses to a string UTF-8 cannot hold; the tokenizer raised TypeError."""
    tok = Tokenizer(demo_model)
    at = next(i for i, c in enumerate(text) if 0xD800 <= ord(c) <= 0xDFFF)
    with pytest.raises(ValueError, match=f"lone surrogate U\\+{ord(text[at]):04X} at character {at}"):
        tok.encode(text)


def test_token_bytes_are_the_byte_level_pieces_raw_bytes(demo_model):
    """Each token's bytes through GPT-2's byte map (transformers' copy as the oracle): a character
    split over tokens gives each its own part, where decode([id]) gives U+FFFD to both."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    byte_of = {c: b for b, c in bytes_to_unicode().items()}
    tok = Tokenizer(demo_model)
    special = set(tok._tok.get_added_tokens_decoder())
    for t in range(tok.vocab_size):
        piece = tok.id_to_token(t)
        want = piece.encode() if t in special else bytes(byte_of[c] for c in piece)
        assert tok.token_bytes(t) == want, (t, piece)
    text = "✓ café, wörld ☃ 語 </s>"
    ids = tok.encode(text, add_special_tokens=False)
    assert any(tok.decode([t]) == "\ufffd" for t in ids)
    assert b"".join(tok.token_bytes(t) for t in ids) == text.encode()


def test_token_bytes_of_sentencepiece_pieces(metaspace_tokenizer, tmp_path):
    """"▁" is a space; a byte-fallback piece `<0xE2>` is that byte."""
    tok = metaspace_tokenizer
    ids = tok.encode("héllo wörld", add_special_tokens=False)
    assert b"".join(tok.token_bytes(t) for t in ids) == " héllo wörld".encode()

    # Llama 2's shape: pieces for the bytes in the vocabulary, used for characters it lacks.
    vocab = {"<unk>": 0, **{f"<0x{b:02X}>": 1 + b for b in range(256)}, "▁": 257, "a": 258, "b": 259, "▁a": 260,
             "▁b": 261}
    hf = HFTokenizer(models.BPE(vocab=vocab, merges=[("▁", "a"), ("▁", "b")], unk_token="<unk>", byte_fallback=True))
    hf.pre_tokenizer = pre_tokenizers.Metaspace()
    hf.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                    decoders.Strip(" ", 1, 0)])
    hf.add_special_tokens(["<s>", "</s>"])
    (tmp_path / "bf").mkdir()
    hf.save(str(tmp_path / "bf" / "tokenizer.json"))
    fallback = Tokenizer(tmp_path / "bf")
    ids = fallback.encode("a ☃ b", add_special_tokens=False)
    assert [fallback.id_to_token(t) for t in ids] == ["▁a", "▁", "<0xE2>", "<0x98>", "<0x83>", "▁b"]
    assert b"".join(fallback.token_bytes(t) for t in ids) == " a ☃ b".encode()
    assert fallback.token_bytes(fallback._tok.token_to_id("</s>")) == b"</s>"


def test_max_token_chars_bounds_every_tokens_text(demo_model, metaspace_tokenizer):
    """No token stands for more characters: text longer than max_model_len times this cannot fit."""
    for tok in (Tokenizer(demo_model), metaspace_tokenizer):
        longest = max(len(tok.decode([t], skip_special_tokens=False)) for t in range(tok.vocab_size))
        assert 1 < longest <= tok.max_token_chars


def test_encoding_lets_other_threads_run(demo_model):
    """The server tokenizes in a thread so its event loop keeps serving; that only helps if the
    tokenizer lets go of the GIL (`encode` held it: a 1 MB prompt froze every other thread 0.4 s)."""
    import threading
    import time

    tok = Tokenizer(demo_model)
    text = "hello world " * 90_000
    gaps: list[float] = []
    done = threading.Event()

    def tick() -> None:
        last = time.perf_counter()
        while not done.is_set():
            time.sleep(0.001)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    ticker = threading.Thread(target=tick)
    ticker.start()
    time.sleep(0.02)
    t0 = time.perf_counter()
    ids = tok.encode(text)
    took = time.perf_counter() - t0
    done.set()
    ticker.join()
    assert len(ids) > 100_000 and took > 0.1
    assert max(gaps) < took / 3, (max(gaps), took)


LLAMA3_LIKE_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|start|>{{ m['role'] }}\n{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|start|>assistant\n{% endif %}"
)


@pytest.fixture
def bos_adding_folder(tmp_path):
    """As Llama 3's: the tokenizer's post-processor adds BOS to every encode, and the chat template
    writes `{{ bos_token }}` too."""
    from tokenizers import processors

    tok = HFTokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<unk>", "<s>", "</s>", "<|start|>", "<|end|>"]
    tok.train_from_iterator(CORPUS * 3, trainers.BpeTrainer(vocab_size=300, special_tokens=specials, show_progress=False))
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", tok.token_to_id("<s>"))])
    tok.save(str(tmp_path / "tokenizer.json"))
    config = {"bos_token": "<s>", "eos_token": "</s>", "chat_template": LLAMA3_LIKE_TEMPLATE}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    return tmp_path


@pytest.mark.parametrize("generation_prompt", [True, False])
def test_chat_ids_are_transformers_one_bos(bos_adding_folder, generation_prompt):
    """The chat route's ids (`encode_chat`) are transformers' `apply_chat_template(tokenize=True)`:
    one BOS, the template's; encoding the template's text as a prompt gave two."""
    from transformers import PreTrainedTokenizerFast

    messages = [{"role": "user", "content": "hello world"}, {"role": "assistant", "content": "the router"}]
    hf = PreTrainedTokenizerFast.from_pretrained(str(bos_adding_folder))
    want = hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=generation_prompt)
    want = want["input_ids"] if isinstance(want, dict) or hasattr(want, "keys") else want
    ours = Tokenizer(bos_adding_folder)
    got = ours.encode_chat(messages, add_generation_prompt=generation_prompt)
    assert got == list(want) and got.count(ours.bos_id) == 1
    assert ours.encode(ours.apply_chat_template(messages, generation_prompt)).count(ours.bos_id) == 2


@pytest.mark.parametrize("post_processor", [False, True])
def test_special_tokens_are_autotokenizers(tmp_path, post_processor):
    """`add_bos_token: true` in tokenizer_config.json adds a BOS only when tokenizer.json's
    post-processor writes one, as transformers' AutoTokenizer (and vLLM, which uses it) does."""
    from tokenizers import processors
    from transformers import AutoTokenizer

    tok = HFTokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    tok.train_from_iterator(CORPUS * 3, trainers.BpeTrainer(vocab_size=120, special_tokens=["<unk>", "<s>", "</s>"],
                                                          show_progress=False))
    if post_processor:
        tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tok.save(str(tmp_path / "tokenizer.json"))
    config = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "add_bos_token": True}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    ours, hf = Tokenizer(tmp_path), AutoTokenizer.from_pretrained(str(tmp_path))
    for text in CORPUS:
        assert ours.encode(text) == hf(text)["input_ids"]
        assert ours.encode(text, add_special_tokens=False) == hf(text, add_special_tokens=False)["input_ids"]
        assert (ours.encode(text)[0] == ours.bos_id) is post_processor
