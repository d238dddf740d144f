"""A chat answer's reasoning split from its content, as vLLM's `--reasoning-parser` does for models
that think between `<think>` and `</think>` before they answer.

- `deepseek_r1` (DeepSeek R1, QwQ): the answer begins in its reasoning (its template may open it
  with `<think>` in the prompt, or the model writes it); everything up to `</think>` is reasoning,
  the rest content; an answer that never closes its reasoning is all reasoning.
- `qwen3` (Qwen3): the answer is in its reasoning if it opens with `<think>` or the prompt ends
  with it (the thinking models' templates); otherwise it is content.

For either, a prompt that ends with `</think>` (a template told not to think: Qwen3's
`enable_thinking: false`) has an answer that is all content. Where the answer begins is
`starts_in_reasoning`; `ReasoningStream` splits the answer's text deltas into (reasoning, content)
pieces as they arrive, holding back only a tail that could be the start of a marker; `split` reads
a whole answer with the same code. The markers must be tokens of the model's vocabulary
(`marker_ids`): structured outputs wait for the end marker's token (worker/engine/engine.py).
"""

from __future__ import annotations

START, END = "<think>", "</think>"
PARSERS: tuple[str, ...] = ("deepseek_r1", "qwen3")  # vLLM's names
_WS = " \t\r\n"


def marker_ids(tokenizer, parser: str) -> tuple[int, int]:
    """The `<think>` and `</think>` token ids; ValueError naming the parser when the vocabulary
    lacks either (vLLM's parsers refuse such a model too)."""
    ids = tuple(tokenizer.token_id(m) for m in (START, END))
    if None in ids:
        raise ValueError(f"--reasoning-parser {parser}: the tokenizer has no {START} and {END} tokens")
    return ids  # type: ignore[return-value]


def starts_in_reasoning(parser: str, prompt_tail: str) -> bool | None:
    """Whether an answer to a prompt ending in `prompt_tail` (its last tokens' text) begins inside its
    reasoning: True, False, or None (qwen3: the answer's own `<think>` decides)."""
    tail = prompt_tail.rstrip(_WS)
    if tail.endswith(END):
        return False
    if tail.endswith(START):
        return True
    return True if parser == "deepseek_r1" else None


class ReasoningStream:
    """One answer's text split as it arrives: `feed(delta)` and at the end `finish()` return
    (reasoning, content) pieces."""

    def __init__(self, start: bool | None) -> None:
        self.start = start
        self.text, self.pos = "", 0
        self.state = "content" if start is False else "lead"

    def feed(self, delta: str) -> tuple[str, str]:
        self.text += delta
        return self._read(final=False)

    def finish(self) -> tuple[str, str]:
        return self._read(final=True)

    def _read(self, final: bool) -> tuple[str, str]:
        reasoning = content = ""
        if self.state == "lead":  # a leading <think> (after any spaces) is dropped
            head = self.text[self.pos :].lstrip(_WS)
            if not final and START.startswith(head):
                return "", ""  # could still be the marker
            if head.startswith(START):
                self.pos = self.text.index(START, self.pos) + len(START)
                self.state = "reasoning"
            else:
                self.state = "reasoning" if self.start else "content"
        if self.state == "reasoning":
            at = self.text.find(END, self.pos)
            if at < 0:
                upto = len(self.text) if final else len(self.text) - _held(self.text, self.pos)
                reasoning, self.pos = self.text[self.pos : upto], upto
                return reasoning, ""
            reasoning, self.pos, self.state = self.text[self.pos : at], at + len(END), "content"
        content, self.pos = self.text[self.pos :], len(self.text)
        return reasoning, content


def _held(text: str, pos: int) -> int:
    """How much of the text's end could be the start of the end marker."""
    return next((n for n in range(min(len(END) - 1, len(text) - pos), 0, -1) if text.endswith(END[:n])), 0)


def split(start: bool | None, text: str) -> tuple[str | None, str | None]:
    """A whole answer as (reasoning, content), each None when empty (vLLM's)."""
    stream = ReasoningStream(start)
    (r1, c1), (r2, c2) = stream.feed(text), stream.finish()
    return (r1 + r2) or None, (c1 + c2) or None
