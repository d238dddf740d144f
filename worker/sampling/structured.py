"""Structured outputs: an answer held to a JSON schema, to any JSON object, to a regular expression,
to one of a list of strings, or to an EBNF grammar (OpenAI's `response_format`, vLLM's `guided_*`
fields and `structured_outputs`), with xgrammar's token masks.

A request's `Constraint` is compiled once per engine and text (xgrammar's compiler caches it) into
a matcher on its sequence. Each step, the matcher of every constrained row fills that row's bit
mask of allowed tokens on the host (`LogitsProcessors.prepare`, `MaskFiller`: one pinned buffer
reused, xgrammar's batch fill from BATCH_FILL_ROWS rows on); the mask is applied to the row's
edited logits on the device before the draw, and the sampled token then advances the matcher
(`LLMEngine._append`). A matcher that reaches the grammar's end finishes the request ("stop");
EOS is allowed only where the grammar may end. Masks need the previous token on the host, so under
async scheduling a constrained row's step is sampled after the step before is read, behind its graph
replay (`Sequence.needs_host_tokens`, worker/engine/async_step.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

Kind = Literal["json", "json_object", "regex", "choice", "grammar"]


class ConstraintError(ValueError):
    """The constraint cannot be compiled (a bad schema, regex or grammar): HTTP 400 naming `param`."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True, slots=True)
class Constraint:
    kind: Kind
    spec: str  # the JSON schema's text, the regex, the choices as a JSON list, the grammar; "" for json_object
    param: str  # the request field it came from, for errors

    @staticmethod
    def choice(options: list[str], param: str) -> Constraint:
        if not options or not all(isinstance(o, str) and o for o in options):
            raise ConstraintError(param, f"{param} must be a non-empty list of non-empty strings")
        return Constraint("choice", json.dumps(options), param)

    @staticmethod
    def schema(schema: Any, param: str) -> Constraint:
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError as exc:
                raise ConstraintError(param, f"{param} is not valid JSON: {exc}") from None
        if not isinstance(schema, dict):
            raise ConstraintError(param, f"{param} must be a JSON schema (an object)")
        return Constraint("json", json.dumps(schema, sort_keys=True), param)


def requested_constraint(response_format: dict[str, Any] | None, guided_json: Any, guided_regex: str | None,
                         guided_choice: list[str] | None, guided_grammar: str | None,
                         structured_outputs: dict[str, Any] | None) -> Constraint | None:
    """The one constraint a request's fields ask for (None: free text): OpenAI's `response_format`,
    vLLM's `guided_*` and its newer `structured_outputs`; ConstraintError (a 400 naming the field)
    for a malformed one or for two at once."""
    found: list[Constraint] = []
    fmt = response_format
    if fmt is not None and fmt.get("type") != "text":
        if fmt.get("type") == "json_object":
            found.append(Constraint("json_object", "", "response_format"))
        elif fmt.get("type") == "json_schema":
            spec = fmt.get("json_schema")
            if not isinstance(spec, dict) or "schema" not in spec:
                raise ConstraintError("response_format", "response_format json_schema needs json_schema.schema")
            found.append(Constraint.schema(spec["schema"], "response_format"))
        else:
            raise ConstraintError("response_format", "response_format type must be text, json_object or json_schema")
    if guided_json is not None:
        found.append(Constraint.schema(guided_json, "guided_json"))
    if guided_regex is not None:
        found.append(Constraint("regex", guided_regex, "guided_regex"))
    if guided_choice is not None:
        found.append(Constraint.choice(guided_choice, "guided_choice"))
    if guided_grammar is not None:
        found.append(Constraint("grammar", guided_grammar, "guided_grammar"))
    for key, value in (structured_outputs or {}).items():  # vLLM's newer spelling of the same
        param = f"structured_outputs.{key}"
        if value is None or value is False:
            continue
        if key == "json":
            found.append(Constraint.schema(value, param))
        elif key == "json_object":
            found.append(Constraint("json_object", "", param))
        elif key in ("regex", "grammar"):
            if not isinstance(value, str):
                raise ConstraintError(param, f"{param} must be a string")
            found.append(Constraint(key, value, param))
        elif key == "choice":
            if not isinstance(value, list):
                raise ConstraintError(param, f"{param} must be a non-empty list of non-empty strings")
            found.append(Constraint.choice(value, param))
        else:
            raise ConstraintError(param, f"{param} is not supported (json, json_object, regex, choice, grammar)")
    if len(found) > 1:
        raise ConstraintError(found[1].param, f"one structured-output constraint per request: {found[0].param} "
                                              f"and {found[1].param} both given")
    return found[0] if found else None


class Grammars:
    """One engine's xgrammar tokenizer info and compiler, made on first use (xgrammar is imported
    only then)."""

    def __init__(self, tokenizer_folder: str | Path, vocab_size: int) -> None:
        self.folder = str(tokenizer_folder)
        self.vocab_size = vocab_size
        self._compiler: Any = None

    def _compile(self, c: Constraint) -> Any:
        import xgrammar as xgr

        if self._compiler is None:
            from transformers import PreTrainedTokenizerFast

            hf = PreTrainedTokenizerFast.from_pretrained(self.folder)
            info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=self.vocab_size)
            self._compiler = xgr.GrammarCompiler(info)
        compiler = self._compiler
        if c.kind == "json_object":  # OpenAI's json_object: an object (xgrammar's builtin grammar takes any value)
            return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
        if c.kind == "json":
            return compiler.compile_json_schema(c.spec, any_whitespace=False)
        if c.kind == "regex":
            return compiler.compile_regex(c.spec)
        if c.kind == "choice":
            return compiler.compile_regex("|".join(_regex_literal(o) for o in json.loads(c.spec)))
        return compiler.compile_grammar(c.spec)

    def matcher(self, c: Constraint, eos_ids: frozenset[int], ignore_eos: bool) -> Any:
        """A fresh xgrammar GrammarMatcher for the constraint; ConstraintError when it cannot compile.

        Where the grammar may end, the mask allows the engine's EOS tokens (all of them: a model may
        have several), so the answer ends as any other; with `ignore_eos` the matcher ends with the
        grammar itself, which finishes the request."""
        try:
            import xgrammar as xgr
        except ImportError:
            raise ConstraintError(c.param, f"{c.param}: structured outputs need xgrammar on the worker "
                                           "(pip install 'lorafleet[engine]')") from None
        try:
            compiled = self._compile(c)
            if ignore_eos or not eos_ids:
                return xgr.GrammarMatcher(compiled, terminate_without_stop_token=True)
            return xgr.GrammarMatcher(compiled, override_stop_tokens=sorted(eos_ids))
        except (RuntimeError, ValueError) as exc:
            raise ConstraintError(c.param, f"{c.param}: cannot compile the constraint: {exc}") from None


def _regex_literal(text: str) -> str:
    """`text` as a regex matching exactly it (xgrammar's regex syntax: escape every metacharacter)."""
    return "".join("\\" + ch if ch in r"\.^$|?*+()[]{}-/" else ch for ch in text)


# Constrained rows from which a step's masks are filled by xgrammar's batch fill, on the engine
# thread (below: each matcher's own fill, as cheap for a few rows). One thread: at a 100,000-token
# vocabulary a row takes 1-3 µs, and each call with more threads paid ~0.1 ms to start them on the
# 2-core development machine (`python -m bench.mask_fill`, docs/benchmarks.md); on one thread the
# batch fill took 1.1-2.3 µs a row from 4 rows on, one by one 1.8-3.1.
BATCH_FILL_ROWS = 4


class MaskFiller:
    """A step's token bit mask (`[batch, ceil(vocab/32)]` int32; allowed tokens set) for its
    constrained rows: filled on the host (BATCH_FILL_ROWS) into one buffer kept from step to step
    (pinned on CUDA), then copied into a device buffer behind the work queued so far. The next fill
    waits for that copy (in practice long done: the host has read the step's tokens since). Rows of
    the batch without a grammar hold whatever they held: `apply_mask` touches only the constrained ones."""

    def __init__(self, vocab_size: int, device: Any) -> None:
        import torch

        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self._host: Any = None
        self._dev: Any = None
        self._copied: Any = None  # CUDA event after the last copy from the host buffer
        self._batch: Any = None  # xgrammar's BatchGrammarMatcher, made at the first large fill

    def fill(self, matchers: list[tuple[int, Any]], batch: int) -> Any:
        """The mask of (batch row, matcher) pairs, on the device (its rows past them undefined)."""
        import torch
        import xgrammar as xgr

        if self._host is None or self._host.shape[0] < batch:
            cuda = self.device.type == "cuda"
            self._host = xgr.allocate_token_bitmask(max(batch, 8), self.vocab_size)
            self._host = self._host.pin_memory() if cuda else self._host
            self._dev = torch.empty_like(self._host, device=self.device) if cuda else self._host
            self._copied = None
        elif self._copied is not None:
            self._copied.synchronize()
        host = self._host[:batch]
        if len(matchers) >= BATCH_FILL_ROWS:
            if self._batch is None:
                self._batch = xgr.BatchGrammarMatcher(1)
            self._batch.batch_fill_next_token_bitmask([m for _, m in matchers], host, [row for row, _ in matchers])
        else:
            for row, matcher in matchers:
                matcher.fill_next_token_bitmask(host, row)
        if self.device.type != "cuda":
            return host
        dev = self._dev[:batch]
        dev.copy_(host, non_blocking=True)
        self._copied = torch.cuda.Event()
        self._copied.record()
        return dev


def warm_up(vocab_size: int, device: Any) -> None:
    """Mask scratch logits of one row and of two, so xgrammar's mask kernel (Triton on CUDA) has
    compiled before the first constrained request (a compile stalls every request of its step);
    nothing when xgrammar is not installed."""
    try:
        import xgrammar as xgr
    except ImportError:
        return
    import torch

    for rows in ([0], [0, 1]):
        apply_mask(torch.zeros(2, vocab_size, device=device), xgr.allocate_token_bitmask(2, vocab_size), rows)


def apply_mask(logits: Any, mask: Any, rows: list[int]) -> None:
    """Masked tokens of `rows` to -inf, in place (logits float32 on any device; the mask is copied
    there unless it is there already, `MaskFiller`)."""
    import xgrammar as xgr

    xgr.apply_token_bitmask_inplace(logits, mask.to(logits.device, non_blocking=True), indices=rows)
