"""Decode throughput by sampling mode on the GPU: what a request's sampling knobs cost the engine.

    python -m bench.sampling_decode [--batch 64] [--prompt-len 128] [--new-tokens 128] [--repeats 2]
                                    [--draws torch,triton] [--groups sampling,edits,host_tokens]
                                    [--out bench/results/sampling-decode-h200.json]
                                    [--tiny]  (a tiny shape on CPU: checks the script, measures nothing)

The seed-shape engine of the one-engine experiments (bench/engine_build.py: random bf16 weights,
CUDA graphs, async scheduling), base-only batches of `--batch` requests. Three groups of cases:

- sampling: every request with the same knobs: greedy, temperature 0.8, top-k 50, top-p 0.9, top-k
  50 with top-p 0.9, min-p 0.05, each with each draw of worker/sampling/sampler.py (LORAFLEET_SAMPLER, one
  process a draw: the torch draw sorts every row for top-p; kernels/sampling/draw_triton.py does not);
- edits: greedy with logit edits on every request (300 `logit_bias` ids; frequency, presence and
  repetition penalties), worker/sampling/logits_processors.py;
- host_tokens: 1, 8 or all of the batch held to a regex that outlasts the run (a grammar's mask
  follows the previous token, so the host must see it first), the rest greedy, the grammars over a
  tokenizer of the model's vocabulary size (`full_vocab_tokenizer`); each with the step's
  sampling deferred behind its replay (`AsyncStepper.defer_sampling`, the default) and without
  (such batches then run synchronous steps).

Cases of one process are interleaved `--repeats` times so the machine's drift hits all of them. Prints tokens/s per
case against greedy, and writes the rows {group, mode, variant, repeat, tokens_per_s, decode_step_ms,
overlapped_steps, deferred_steps} (the async path's counts over the run).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from bench.engine_build import build_engine, experiment_engine, full_vocab_tokenizer
from bench.engine_workload import adapter_sets, decode_run
from bench.sampling_cost import MODES
from bench.variants import run_child
from lorafleet.worker import envs
from lorafleet.worker.sampling.structured import Constraint, Grammars

EDIT_MODES = {
    "logit_bias": dict(temperature=0.0, logit_bias=tuple((t, 1.0) for t in range(10, 3010, 10))),
    "penalties": dict(temperature=0.0, frequency_penalty=0.5, presence_penalty=0.5, repetition_penalty=1.1),
}
# Never complete within a run (1,000 characters; the demo tokenizer's tokens are 1-4 of them).
LONG_REGEX = Constraint("regex", "[a-z ]{1000}", "guided_regex")
HOST_TOKEN_COUNTS = (1, 8, 64)


@dataclass(slots=True)
class Case:
    group: str
    mode: str
    variant: str  # the draw, or deferred / synchronous
    knobs: dict
    leading: tuple[int, dict] = (0, {})  # decode_run's: the first n requests' extra fields
    setup: Callable[[], None] = field(default=lambda: None)


def cases(engine, batch: int, draw: str, groups: set[str]) -> list[Case]:
    """The cases one process runs: its draw (LORAFLEET_SAMPLER, read at start-up) is `draw`."""
    def defer(on: bool) -> Callable[[], None]:
        return lambda: setattr(engine.async_steps, "defer_sampling", on)

    greedy = MODES["greedy"]
    out = [Case("sampling", "greedy", "-", greedy, setup=defer(True))]
    if "sampling" in groups:
        out += [Case("sampling", name, draw, knobs, setup=defer(True)) for name, knobs in MODES.items()
                if name != "greedy"]
    if "edits" in groups:
        vocab = engine.model_config.vocab_size  # (the tiny shape's is 1,000)
        out += [Case("edits", name, "-", {**knobs, "logit_bias": tuple(b for b in knobs.get("logit_bias", ()) if b[0] < vocab)},
                     setup=defer(True))
                for name, knobs in EDIT_MODES.items()]
    if "host_tokens" in groups:
        out += [Case("host_tokens", f"regex {n}/{batch}", variant, greedy, (n, {"constraint": LONG_REGEX}),
                     defer(variant == "deferred"))
                for n in HOST_TOKEN_COUNTS if n <= batch for variant in ("deferred", "synchronous")]
    return out


def run_cases(args: argparse.Namespace, draw: str) -> list[dict]:
    """This process's cases (its draw is the one LORAFLEET_SAMPLER chose at start-up), interleaved
    `--repeats` times; one row a case and repeat."""
    if args.tiny:  # the graph path run uncaptured, with async scheduling, as the CPU tests run it
        tiny = argparse.Namespace(tiny=True, rank=16, batch=args.batch, modes="async")
        engine, names = build_engine(tiny, "cpu", 1)[0], ["-"]
        engine.async_steps.enabled = True
    else:
        engine, names = experiment_engine(args.batch, 1)
    # The grammars read a tokenizer of the model's vocabulary size (xgrammar's per-token work follows
    # it); the engine's own detokenizer stays the demo's (bench/engine_build.py, full_vocab_tokenizer).
    vocab = engine.model_config.vocab_size
    engine.grammars = Grammars(full_vocab_tokenizer(Path(tempfile.mkdtemp()), vocab), vocab)
    sets = adapter_sets(names, 0, args.batch)
    todo = cases(engine, args.batch, draw, set(args.groups.split(",")))
    for case in todo:  # warm-up: JIT, graph buckets, grammar compiles
        case.setup()
        decode_run(engine, sets, args.prompt_len, 16, case.knobs, case.leading)
    rows = []
    for rep in range(args.repeats):
        for case in todo:
            case.setup()
            stats = engine.async_steps.stats
            before = (stats.overlapped, stats.deferred)
            res = decode_run(engine, sets, args.prompt_len, args.new_tokens, case.knobs, case.leading)
            rows.append({"group": case.group, "mode": case.mode, "variant": case.variant, "draw": draw, "repeat": rep,
                         "tokens_per_s": res["tokens_per_s"], "decode_step_ms": res["decode_step_ms"],
                         # steps launched before the previous one was read, and of those, sampled after it
                         "overlapped_steps": stats.overlapped - before[0], "deferred_steps": stats.deferred - before[1]})
            print(f"{case.group:12} {case.mode:22} {case.variant:12} {res['tokens_per_s']:>10,.0f} tok/s  "
                  f"step {res['decode_step_ms']} ms", flush=True)
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--draws", default="torch,triton")
    ap.add_argument("--groups", default="sampling,edits,host_tokens")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--tiny", action="store_true", help="tiny shape on CPU: checks the script, measures nothing")
    ap.add_argument("--rows-to", type=Path, help=argparse.SUPPRESS)  # a child process: its rows, as JSON
    args = ap.parse_args(argv)
    if args.rows_to:
        args.rows_to.write_text(json.dumps(run_cases(args, envs.SAMPLER)))
        return
    # One process a draw, LORAFLEET_SAMPLER set in its environment (the setting a user has); the
    # groups that do not depend on the draw run with the first.
    rows: list[dict] = []
    for i, draw in enumerate(args.draws.split(",")):
        groups = args.groups if i == 0 else ",".join(g for g in args.groups.split(",") if g == "sampling")
        if not groups:
            continue
        rows += run_child("bench.sampling_decode", {"LORAFLEET_SAMPLER": draw}, _child_argv(args, draw, groups))
    def median(key: tuple[str, str, str, str]) -> float:
        return statistics.median(r["tokens_per_s"] for r in rows if (r["group"], r["mode"], r["variant"], r["draw"]) == key)

    # Each process has its own greedy run: a case is compared with the greedy run of its process.
    print(f"\n{'group':12} {'mode':22} {'variant':12} {'tok/s':>10} {'vs greedy':>10}")
    for key in dict.fromkeys((r["group"], r["mode"], r["variant"], r["draw"]) for r in rows):
        tps = median(key)
        greedy = median(("sampling", "greedy", "-", key[3]))
        print(f"{key[0]:12} {key[1]:22} {key[2]:12} {tps:>10,.0f} {tps / greedy:>10.3f}")
    if args.out:
        device = "cpu (--tiny smoke run)" if args.tiny else torch.cuda.get_device_name()
        meta = {"device": device, "torch": torch.__version__, "batch": args.batch,
                "prompt_len": args.prompt_len, "new_tokens": args.new_tokens}
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")


def _child_argv(args: argparse.Namespace, draw: str, groups: str) -> list[str]:
    argv = ["--batch", str(args.batch), "--prompt-len", str(args.prompt_len), "--new-tokens", str(args.new_tokens),
            "--repeats", str(args.repeats), "--draws", draw, "--groups", groups]
    return argv + (["--tiny"] if args.tiny else [])


if __name__ == "__main__":
    main()
