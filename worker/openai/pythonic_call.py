"""One Python-syntax tool call, `name(key=literal, ...)`, read as its text arrives: the format of
vLLM's `pythonic` tool parser (Llama 3.2 and Llama 4 write their calls as a Python list of them).

`PythonicCall.scan` reads as far as the text goes and keeps its place. Each keyword argument is
taken once its value is whole (a top-level `,` or `)` after it) and turned into JSON
(`ast.literal_eval`, then `json.dumps`), so a call's arguments can go out argument by argument as
a JSON object being written: `arguments_pieces` returns what is new. What is not a call of that
shape (a positional argument, a value that is not a Python literal or has no JSON form, a repeated
key, a name that is not an identifier) makes the scan `bad`.
"""

from __future__ import annotations

import ast
import json

_WS = " \t\r\n"
_OPEN, _CLOSE = "([{", ")]}"


def _identifier(text: str) -> bool:
    return all(part.isidentifier() for part in text.split("."))


class PythonicCall:
    """The scan of one call from its first character at `start` in a growing text: `name` once its
    `(` is read, the arguments taken so far (`args`: key, JSON text), `end` just past its `)`, or
    `bad`."""

    def __init__(self, start: int) -> None:
        self.pos, self.start, self.phase = start, start, "name"
        self.name: str | None = None
        self.args: list[tuple[str, str]] = []
        self.end: int | None = None
        self.bad = False
        self._key_start = self._value_start = 0
        self._arg = ""
        self._depth, self._quote, self._escaped = 0, "", False
        self._sent = 0  # arguments handed out by arguments_pieces (-1: the closing brace too)

    def scan(self, text: str) -> None:
        i = self.pos
        while i < len(text) and self.end is None and not self.bad:
            c = text[i]
            if self.phase == "value":
                self._at_value(text, i, c)
            else:
                getattr(self, f"_at_{self.phase}")(text, i, c)
            i += 1
        self.pos = i

    def arguments_pieces(self) -> str:
        """The arguments' JSON text not handed out yet: `{"key": value` for the first argument,
        `, "key": value` for the next ones, `}` (or `{}`) once the call has ended."""
        if self._sent < 0:
            return ""
        out = [("{" if n == 0 else ", ") + json.dumps(k, ensure_ascii=False) + ": " + v
               for n, (k, v) in enumerate(self.args[self._sent :], self._sent)]
        self._sent = len(self.args)
        if self.end is not None:
            out.append("}" if self.args else "{}")
            self._sent = -1
        return "".join(out)

    # -- phases -----------------------------------------------------------------------------------

    def _at_name(self, text: str, i: int, c: str) -> None:
        if c == "(":
            name = text[self.start : i].strip()
            self.bad = not _identifier(name)
            self.name, self.phase, self._key_start = name, "key", i + 1
        elif c in _WS:
            self.phase = "name_end"
        elif not (c.isalnum() or c in "_."):
            self.bad = True

    def _at_name_end(self, text: str, i: int, c: str) -> None:
        if c == "(":
            self._at_name(text, i, c)
        elif c not in _WS:
            self.bad = True

    def _at_key(self, text: str, i: int, c: str) -> None:
        if c == "=":
            key = text[self._key_start : i].strip()
            self.bad = not key.isidentifier() or any(k == key for k, _ in self.args)
            self._arg, self.phase, self._value_start = key, "value", i + 1
        elif c == ")" and not text[self._key_start : i].strip():  # `f()`, or a trailing comma
            self.end = i + 1
        elif not (c.isalnum() or c == "_" or c in _WS):
            self.bad = True  # a positional argument, or not a call

    def _at_value(self, text: str, i: int, c: str) -> None:
        if self._quote:
            if self._escaped:
                self._escaped = False
            elif c == "\\":
                self._escaped = True
            elif c == self._quote:
                self._quote = ""
        elif c in "'\"":
            self._quote = c
        elif c in _OPEN:
            self._depth += 1
        elif self._depth:
            self._depth -= c in _CLOSE
        elif c in ",)":
            self._take(text[self._value_start : i])
            if self.bad:
                return
            if c == ")":
                self.end = i + 1
            else:
                self.phase, self._key_start = "key", i + 1

    def _take(self, source: str) -> None:
        try:
            value = json.dumps(ast.literal_eval(source.strip()), ensure_ascii=False, allow_nan=False)
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
            self.bad = True
            return
        self.args.append((self._arg, value))
