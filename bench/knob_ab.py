"""A LoRA tuning field's settings timed against each other over the kernel table's cases, on the GPU.

    python -m bench.knob_ab --knob split_sum --settings loop,unroll [--rounds 2]
                            [--min-tokens 16] [--max-adapters N] [--cases MODULE:TOKENS:ADAPTERS,...]
                            [--out bench/results/knob-ab-h200.json]

For each case (bench/kernels.py's table with at least --min-tokens tokens, or --cases at rank 16),
`add_lora_triton` is timed with the config `pick_config` chooses from the process's tuning
(`lorafleet.kernels.lora.tuning.LoraTuning`) with the field KNOB set to each setting in turn (a
setting is a Python literal, or a plain string; the tuning is passed in), --rounds times over,
settings interleaved within a case so a drift of the machine hits all of them. Timing as in
bench/kernels.py. Prints each case's median per setting and its ratio to the first; rows
{case..., setting, round, lora_us, floor_us, rel_err, and the launch config's fields}.
"""

from __future__ import annotations

import argparse
import ast
import json
import statistics
from collections.abc import Callable
from dataclasses import asdict, fields
from pathlib import Path

import torch

from bench.graph_timing import measure_copy_bandwidth
from bench.kernel_cases import MODULES, case_meta, case_token_slots, main_cases, parse_cases
from bench.kernel_runner import run_case
from lorafleet.kernels.lora.config import LoraKernelConfig, config_for_meta
from lorafleet.kernels.lora.tuning import LoraTuning, active_tuning, tuning_from_dict

# Tuning fields the launch reads itself (launch.py: split_sum_code's bounds), not through the config a
# case is timed with.
LAUNCH_TIME_FIELDS = ("max_unrolled_splits", "unroll_max_partial_bytes")


def parse_setting(text: str) -> object:
    """A Python literal ("(True, False)", "32"), else the text itself ("tile")."""
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def split_settings(text: str) -> list[str]:
    """Comma-separated settings, commas inside brackets kept: "(True, False),(False, False)" is two."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append(text[start:i].strip())
            start = i + 1
    parts.append(text[start:].strip())
    return parts


def run(knob: str, settings: dict[str, object], args: argparse.Namespace,
        row_extra: Callable[[LoraKernelConfig], dict] = asdict) -> list[dict]:
    """Time each case under each setting of the tuning field `knob` (the process's tuning, that field
    replaced; lists become tuples as in a tuning file)."""
    cases = parse_cases(args.cases) if args.cases else [
        c for c in main_cases(False)
        if c.tokens >= args.min_tokens and (args.max_adapters is None or c.adapters <= args.max_adapters)]
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    bandwidth = measure_copy_bandwidth()
    print(f"device {torch.cuda.get_device_name()}, copy bandwidth {bandwidth / 1e12:.2f} TB/s; "
          f"{knob}: {settings}", flush=True)
    names = list(settings)
    tunings = {name: tuning_for(knob, value) for name, value in settings.items()}
    rows = []
    for case in cases:
        d_in, outs = MODULES[case.module]
        slots = case_token_slots(case)
        meta = case_meta(case, slots, torch.ones(slots.shape))
        us: dict[str, list[float]] = {s: [] for s in names}
        for rnd in range(args.rounds):
            for name in names:
                cfg = config_for_meta(meta, len(outs), d_in, tunings[name])
                row = run_case(case, bandwidth, g, config=cfg, baselines=False)
                us[name].append(row["lora_us"])
                rows.append({**asdict(case), "setting": name, "round": rnd, "lora_us": row["lora_us"],
                             "floor_us": row["floor_us"], "rel_err": row["rel_err"], **row_extra(cfg)})
        med = {s: statistics.median(t) for s, t in us.items()}
        print(f"{case.module:8s} T={case.tokens:4d} A={case.adapters:3d} r={case.rank:2d}/{case.pool_rank:2d} "
              f"k={case.k} {case.b_layout[:4]}: " + "  ".join(
                  f"{s}: {med[s]:6.2f} ({med[s] / med[names[0]]:.3f})" for s in names), flush=True)
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(rows, indent=1))
        torch.cuda.empty_cache()
    return rows


def tuning_for(knob: str, value: object, base: LoraTuning | None = None) -> LoraTuning:
    """The process's tuning (or `base`) with one field set; an unknown field or a bad value raises
    ValueError naming it."""
    return tuning_from_dict({knob: value}, active_tuning() if base is None else base)


def parser(description: str, out: str, settings: str | None = None) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=description)
    if settings is None:
        ap.add_argument("--knob", required=True, help="a field of lorafleet.kernels.lora.tuning.LoraTuning")
        ap.add_argument("--settings", required=True, help="comma-separated values (Python literals or strings)")
    else:
        ap.add_argument("--settings", default=settings)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--min-tokens", type=int, default=16)
    ap.add_argument("--max-adapters", type=int, default=None, help="only the table's cases with at most this many")
    ap.add_argument("--cases", default=None, help="MODULE:TOKENS:ADAPTERS,... (rank 16) instead of the table's "
                                                  "(then --min-tokens and --max-adapters do not apply)")
    ap.add_argument("--out", default=out)
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = parser(__doc__.splitlines()[0], "bench/results/knob-ab-h200.json")
    args = ap.parse_args(argv)
    if args.knob not in {f.name for f in fields(LoraTuning)}:
        ap.error(f"LoraTuning has no field {args.knob}")
    if args.knob in LAUNCH_TIME_FIELDS:
        ap.error(f"{args.knob} is read at launch from the process's tuning, not from the config: compare it with "
                 f"LORAFLEET_LORA_TUNING in a process a setting")
    parts = split_settings(args.settings)
    if "" in parts or len(set(parts)) != len(parts):
        ap.error(f"--settings needs distinct, non-empty values: {args.settings!r}")
    settings = {p: parse_setting(p) for p in parts}
    for p, value in settings.items():
        try:
            tuning_for(args.knob, value)
        except (ValueError, TypeError) as e:
            ap.error(f"--settings {p}: {e}")
    run(args.knob, settings, args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
