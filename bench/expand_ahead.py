"""The tl.dot expand's loads ahead (`lora_config.EXPAND_AHEAD`) over the kernel table's cases, on the GPU.

    python -m bench.expand_ahead [--settings off,few,all] [--rounds 2] [--min-tokens 16] [--max-adapters N]
                                 [--cases MODULE:TOKENS:ADAPTERS,...] [--out bench/results/expand-ahead-h200.json]

For each case (bench/kernels.py's table with at least --min-tokens tokens, or --cases at rank 16),
`add_lora_triton` at `pick_config`'s default is timed under each setting of EXPAND_AHEAD in turn
(off: never; few: with at most SHRINK_FEW_CHUNKS chunks, the default; all: always), --rounds
times over (settings interleaved within a case, so a drift of the machine hits all of them). A
setting applies only to expands of several tiles a program (`pick_config`). Timing as in
bench/kernels.py. Prints each case's median per setting and its ratio to the first; rows
{case..., setting, expand_ahead, round, lora_us}.

`expand-ahead-h200.json` is from the knob's first form (commit f1b180c): one int for every launch,
0 = off, 1 = y loaded with B (no change), 2 = ahead, programs of one tile included (where it ran
1.1-1.5x slower: hence only several tiles now). `expand-ahead-early-h200.json` is from commit f0797df,
whose setting few-early also issued the second tile's loads with the first's, before the wait for
the shrink (`EXPAND_AHEAD_EARLY`, removed after it: docs/benchmarks-history.md, twentieth session);
`expand-ahead-peel-h200.json` from 42b7abd, whose few was the lookahead with the last tile peeled
off the loop (`EXPAND_AHEAD_PEEL`, removed after it) and few-loop the loop form kept.
"""

from __future__ import annotations

from bench import knob_ab

SETTINGS = {"off": (False, False), "few": (True, False), "all": (True, True)}


def main(argv: list[str] | None = None) -> int:
    ap = knob_ab.parser(__doc__.splitlines()[0], "bench/results/expand-ahead-h200.json", settings="off,few,all")
    args = ap.parse_args(argv)
    settings = args.settings.split(",")
    unknown = sorted(set(settings) - set(SETTINGS))
    if unknown:
        ap.error(f"unknown settings {unknown}; choose from {sorted(SETTINGS)}")
    knob_ab.run("EXPAND_AHEAD", {s: SETTINGS[s] for s in settings}, args,
                row_extra=lambda cfg: {"expand_ahead": cfg.expand_ahead})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
