"""Stop strings and min_tokens in the streamed text (`outputs.TrackedRequest`), with a detokenizer
that maps each token id to a fixed string: a stop string in the text of the first min_tokens
tokens ends nothing and none of it is held back or cut later; one after them cuts as usual."""

from __future__ import annotations

from lorafleet.worker.engine.outputs import TrackedRequest
from lorafleet.worker.engine.sequence import SamplingParams, Sequence

PIECES = {1: "x", 2: "ab", 3: "c", 4: "d", 5: "a", 6: "b"}


class PieceDetokenizer:
    def __init__(self) -> None:
        self.text = ""

    def update(self, ids: list[int]) -> None:
        self.text = "".join(PIECES[t] for t in ids)

    def finish(self, ids: list[int]) -> str:
        self.update(ids)
        return self.text


def stream(tokens: list[int], max_tokens: int = 10, **knobs) -> list[tuple[str, str | None]]:
    seq = Sequence(seq_id=0, prompt_ids=[9], sampling=SamplingParams(max_tokens=max_tokens, **knobs))
    tracked = TrackedRequest(seq, PieceDetokenizer())  # type: ignore[arg-type]
    out = []
    for t in tokens:
        seq.output_ids.append(t)
        out.append(tracked.text_delta(None, False))
        if out[-1][1]:
            break
    return out


def test_a_stop_string_before_min_tokens_ends_nothing_and_leaks_nothing():
    deltas = stream([1, 2, 3, 4], stop=("ab",), min_tokens=2)
    assert [r for _, r in deltas] == [None] * 4
    assert "".join(d for d, _ in deltas) == "xabc"  # "d" held back while a stop could still form


def test_a_stop_string_after_min_tokens_cuts_the_text():
    deltas = stream([1, 3, 5, 6, 4], stop=("ab",), min_tokens=2)  # "x" "c" | "a" "b": the stop starts after
    assert deltas[-1][1] == "stop" and "".join(d for d, _ in deltas) == "xc"


def test_without_min_tokens_the_first_token_can_stop():
    deltas = stream([2, 3], stop=("ab",))
    assert deltas == [("", "stop")]
