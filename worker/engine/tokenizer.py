"""Tokenizer and chat template from a Hugging Face folder (`tokenizer.json`, `tokenizer_config.json`)."""

from __future__ import annotations

import json
import re
from pathlib import Path

# Used when the folder has no chat template (documented in the README).
DEFAULT_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}{{ eos_token }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


class Tokenizer:
    def __init__(self, folder: str | Path) -> None:
        from tokenizers import Tokenizer as HFTokenizer

        root = Path(folder)
        path = root / "tokenizer.json"
        if not path.is_file():
            raise ValueError(f"{folder} has no tokenizer.json")
        self._tok = HFTokenizer.from_file(str(path))
        cfg_path = root / "tokenizer_config.json"
        cfg = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
        self.bos_token = _token_text(cfg.get("bos_token"))
        self.eos_token = _token_text(cfg.get("eos_token"))
        self.bos_id = self._tok.token_to_id(self.bos_token) if self.bos_token else None
        self.eos_id = self._tok.token_to_id(self.eos_token) if self.eos_token else None
        template = cfg.get("chat_template")
        if isinstance(template, list):  # named templates: take the default one
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        self.chat_template: str = template or DEFAULT_CHAT_TEMPLATE
        self.has_own_chat_template = template is not None
        self.vocab_size = self._tok.get_vocab_size()
        # The most characters one token stands for: a piece's length bounds its text's (a byte-level
        # piece has a character per byte; "▁" is one space; "<0xE2>" is less than one character).
        self.max_token_chars = max(map(len, self._tok.get_vocab(with_added_tokens=True)), default=1)
        added = self._tok.get_added_tokens_decoder()
        self._added_ids = frozenset(added)
        # What decode(skip_special_tokens=True) leaves out of the text.
        self.special_ids = frozenset(i for i, token in added.items() if token.special)
        self._pieces = _PieceDecoding.of(self._tok.decoder)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Raises ValueError for text UTF-8 cannot hold (a lone surrogate, from JSON's "\\ud800").

        `encode_batch` because it lets go of the GIL (`encode` holds it): a server tokenizing in a
        thread keeps its event loop serving.
        """
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise ValueError(
                f"the text has a lone surrogate U+{ord(text[exc.start]):04X} at character {exc.start}: it is not "
                "valid Unicode (a \\uD800-\\uDFFF escape is only valid as half of a surrogate pair)"
            ) from None
        # The special tokens are the post-processor's in tokenizer.json alone: transformers 5's
        # AutoTokenizer and vLLM add no BOS for `add_bos_token: true` in tokenizer_config.json when
        # tokenizer.json has no post-processor writing one (Llama's tokenizer.json does).
        return self._tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str:
        return self._tok.id_to_token(token_id) or ""

    def token_id(self, text: str) -> int | None:
        """The id of the token that is exactly `text` (an added token's content, or a vocabulary
        entry), or None."""
        return self._tok.token_to_id(text)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes a token stands for (OpenAI's logprobs `bytes`): with byte-level or byte-fallback
        pieces a token may hold part of a UTF-8 character, which `decode([token_id])` turns into
        U+FFFD; these bytes, concatenated over tokens, are the text's."""
        piece = self.id_to_token(token_id)
        if token_id in self._added_ids:
            return piece.encode()
        raw = self._pieces.bytes_of(piece)
        return raw if raw is not None else self.decode([token_id], skip_special_tokens=False).encode()

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True, tools: list | None = None,
                    add_special_tokens: bool = False, template_kwargs: dict | None = None) -> list[int]:
        """The chat template's text, tokenized without adding special tokens: the template writes
        them (a BOS from `{{ bos_token }}`), as transformers' `apply_chat_template(tokenize=True)`
        and vLLM do; adding them again gave Llama 3's templates two BOS tokens. (`add_special_tokens`:
        /tokenize's option, as vLLM's.)"""
        text = self.apply_chat_template(messages, add_generation_prompt, tools, template_kwargs)
        return self.encode(text, add_special_tokens=add_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: list | None = None, template_kwargs: dict | None = None) -> str:
        """The template's text; `tools` (OpenAI's tool dicts) reach it as `tools`, as in transformers,
        and `template_kwargs` (vLLM's `chat_template_kwargs`: `enable_thinking`, ...) as variables of
        their own names (not the ones set here: TEMPLATE_VARIABLES)."""
        import jinja2
        import jinja2.sandbox

        env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)

        def raise_exception(message: str) -> None:
            raise ValueError(message)

        env.globals["raise_exception"] = raise_exception
        try:
            return env.from_string(self.chat_template).render(
                **(template_kwargs or {}),
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                tools=tools,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
            )
        except (jinja2.TemplateError, TypeError, ValueError, ArithmeticError, LookupError, AttributeError) as exc:
            # The template's own errors, and what request values (messages, chat_template_kwargs)
            # make it do: bad input, a 400, not a crash.
            raise ValueError(f"chat template failed: {type(exc).__name__}: {exc}") from None


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level alphabet: a character per byte, printable ones standing for themselves
    and the others (controls, space, ...) moved to 256 upwards in their order."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    moved = [b for b in range(256) if b not in kept]
    return {chr(b): b for b in kept} | {chr(256 + i): b for i, b in enumerate(moved)}


_BYTE_LEVEL = _byte_level_alphabet()
_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


class _PieceDecoding:
    """How a tokenizer's decoder turns one vocabulary piece into bytes, read from its settings:
    byte-level (GPT-2, Llama 3, Qwen), or SentencePiece's "▁" for a space with byte-fallback
    pieces (Llama 2, Mistral). Other decoders: None (the caller decodes the token as text)."""

    def __init__(self, byte_level: bool, byte_fallback: bool, replace: list[tuple[str, str]]) -> None:
        self.byte_level = byte_level
        self.byte_fallback = byte_fallback
        self.replace = replace

    @classmethod
    def of(cls, decoder: object | None) -> _PieceDecoding:
        pending = [json.loads(decoder.__getstate__())] if decoder is not None else []
        kinds, replace = set(), []
        while pending:
            d = pending.pop(0)
            kinds.add(d.get("type"))
            pending.extend(d.get("decoders") or ())
            if d.get("type") == "Replace" and "String" in (d.get("pattern") or {}):
                replace.append((d["pattern"]["String"], d.get("content", "")))
            elif d.get("type") == "Metaspace":
                replace.append((d.get("replacement", "▁"), " "))
        return cls("ByteLevel" in kinds, "ByteFallback" in kinds, replace)

    def bytes_of(self, piece: str) -> bytes | None:
        if self.byte_level:
            raw = [_BYTE_LEVEL.get(c) for c in piece]
            return None if None in raw else bytes(raw)  # type: ignore[arg-type]
        if self.byte_fallback and (m := _BYTE_PIECE.fullmatch(piece)):
            return bytes([int(m[1], 16)])
        if not (self.byte_fallback or self.replace):
            return None
        for old, new in self.replace:
            piece = piece.replace(old, new)
        return piece.encode()


def _token_text(value: object) -> str | None:
    if isinstance(value, dict):  # AddedToken serialised
        return value.get("content")
    return value if isinstance(value, str) else None


# What apply_chat_template sets itself: chat_template_kwargs may not name them.
# (`self` is render's own argument; range, dict, namespace, ... jinja's globals, which templates call.)
TEMPLATE_VARIABLES = frozenset({"messages", "add_generation_prompt", "tools", "bos_token", "eos_token",
                                "raise_exception", "self", "range", "dict", "lipsum", "cycler", "joiner",
                                "namespace"})


class IncrementalDetokenizer:
    """Text deltas for streamed tokens, decoding a short window per token (O(1) per step, not O(n)).

    The window starts a few tokens before the new ones (the last prompt tokens at first), so
    tokenizers that mark word starts on the token (SentencePiece's "▁") keep the spaces between
    words; a trailing partial UTF-8 character is held back until it completes, and left out if the
    request ends first (vLLM's rule).
    `text` is the sum of the deltas so far.
    """

    CONTEXT_TOKENS = 4

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int] | None = None,
                 skip_special_tokens: bool = True) -> None:
        self.tokenizer, self.skip_special_tokens = tokenizer, skip_special_tokens
        self._ids = list(prompt_ids or [])[-self.CONTEXT_TOKENS :]  # context, then the outputs seen
        self._consumed = 0  # output ids in _ids
        self._prefix = 0  # _ids[_prefix:_read] is already text; the window starts there
        self._read = len(self._ids)
        self.text = ""

    def _window(self, output_ids: list[int]) -> tuple[str, str]:
        if len(output_ids) < self._consumed:
            raise ValueError("output ids only grow")
        self._ids.extend(output_ids[self._consumed :])
        self._consumed = len(output_ids)
        skip = self.skip_special_tokens
        done = self.tokenizer.decode(self._ids[self._prefix : self._read], skip_special_tokens=skip)
        return done, self.tokenizer.decode(self._ids[self._prefix :], skip_special_tokens=skip)

    def update(self, output_ids: list[int]) -> str:
        done, new = self._window(output_ids)
        if len(new) <= len(done) or new.endswith("\ufffd"):
            return ""
        delta = new[len(done) :]
        self.text += delta
        self._prefix, self._read = self._read, len(self._ids)
        return delta

    def finish(self, output_ids: list[int]) -> str:
        """The final text. A trailing partial character (an answer cut between the byte tokens of
        one character) is left out, as vLLM's detokenizer (tokenizers' DecodeStream) never emits it.
        Token by token, so text completed before that character is kept."""
        for end in range(self._consumed + 1, len(output_ids) + 1):
            self.update(output_ids[:end])
        return self.text
